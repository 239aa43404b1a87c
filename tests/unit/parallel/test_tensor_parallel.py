"""tensor_parallel_size=2 on CPU (gloo between two processes): the same greedy tokens as
one rank, each rank holding half the weights and half the KV cache, and a rank that dies
failing the requests in flight instead of hanging them. Each test starts (and stops) one
worker process; greedy equality is an fp32 promise (partial sums add in another order)."""

import os
import signal
import time

import pytest

from backend import LLM, EngineArgs, SamplingParams
from backend.engine.engine_loop import EngineLoop
from backend.engine.errors import EngineDeadError
from backend.engine.llm_engine import LLMEngine
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import hf_greedy, make_checkpoint
from tests.helpers.graphs import EagerReplayGraphs
from tests.helpers.prompt_logprobs import check_against_transformers

LENGTHS = [1, 200, 7, 64, 33, 150, 2, 99, 16, 120]
MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0)
# 100 blocks of 4 tokens cannot hold the ten sequences at once: preemption, chunks, hits.
TIGHT = dict(block_size=4, num_kv_blocks=100, max_num_seqs=16, max_num_batched_tokens=48, dtype="float32")


def _prompts():
    prompts = random_prompts(len(LENGTHS), LENGTHS, seed=1)
    return prompts + [prompts[1][:120] + [5, 6, 7]]     # shares 30 full blocks with prompt 1


@pytest.mark.parametrize("arch, overrides, engine", [
    ("llama", {}, {}),                                          # 4 heads, 2 KV heads: one each
    ("llama", {"num_key_value_heads": 1}, {}),                  # GQA, fewer KV heads than ranks
    ("qwen2", {"vocab_size": 321}, {}),                         # qkv bias, tied, padded vocab
    ("llama", {"attention_bias": True, "mlp_bias": True}, {}),  # row-parallel biases: added once
    ("gemma2", {}, {}),                                         # soft-caps per head, windows, sandwich norms
    # Verification steps (k + 1 tokens per sequence, rollback) on both ranks.
    ("llama", {"initializer_range": 0.05}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3}}),
], ids=["llama", "llama-1-kv-head", "qwen2-bias-odd-vocab", "llama-every-bias", "gemma2", "llama-ngram-speculation"])
def test_two_ranks_give_the_single_rank_greedy_tokens(ckpt_dir, arch, overrides, engine):
    name = "_".join([f"tp_{arch}"] + [f"{k}{v}" for k, v in overrides.items()])
    path = make_checkpoint(str(ckpt_dir / name), arch, **overrides)
    prompts = _prompts()
    expected = hf_greedy(path, prompts, MAX_NEW)   # what one rank gives (tests/unit/engine/test_exactness.py)
    # One asks for prompt logprobs: its rows' logits are gathered on rank 0 like the rest.
    params = [GREEDY.model_copy(update={"prompt_logprobs": 2}) if i == 3 else GREEDY for i in range(len(prompts))]
    with LLM(path, tensor_parallel_size=2, **TIGHT, **engine) as llm:
        outs = llm.generate(prompts, params)
        for i, (out, ref) in enumerate(zip(outs, expected)):
            assert out.token_ids == ref, f"prompt {i} (len {len(prompts[i])}) differs"
        check_against_transformers(path, prompts[3], outs[3].prompt_logprobs, 2)
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0
        assert stats["prefix_cache_hit_tokens"] >= 120
        if engine:
            assert stats["spec_decode_num_accepted_tokens"] > 0
        assert_pool_free(llm)


def test_two_ranks_with_lora_adapters_give_peft_tokens(ckpt_dir, tmp_path):
    """Each rank holds its shard of every adapter (B split with column-parallel outputs, A
    with row-parallel inputs) and mirrors rank 0's slot choices from the adapter ids sent
    each step: two adapters and the base model in one batch, max_loras 1 (slots swap),
    chunked prefill and preemption, give transformers + PEFT's tokens."""
    from tests.helpers.adapters import make_adapter, peft_greedy
    path = make_checkpoint(str(ckpt_dir / "tp_llama"), "llama")
    adapters = {"all": make_adapter(path, str(tmp_path / "all"), rank=8, seed=1),
                "qv": make_adapter(path, str(tmp_path / "qv"), rank=4, targets=("q_proj", "v_proj", "o_proj",
                                                                               "down_proj"), seed=2)}
    prompts = _prompts()[:6]
    names = [[None, "all", "qv"][i % 3] for i in range(len(prompts))]
    refs = {n: peft_greedy(path, adapters.get(n), prompts, MAX_NEW) for n in (None, "all", "qv")}
    with LLM(path, tensor_parallel_size=2, lora_modules=adapters, max_loras=1, **{**TIGHT, "num_kv_blocks": 64}) as llm:
        outs = llm.generate(prompts, [SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0,
                                                     lora_name=n) for n in names])
        for i, (out, name) in enumerate(zip(outs, names)):
            assert out.token_ids == refs[name][i], f"prompt {i} under {name}"
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0
        assert llm.engine.lora.num_slot_loads > 2
        assert_pool_free(llm)


def test_each_rank_holds_half_the_weights_and_kv_cache(llama_ckpt):
    single = LLM(llama_ckpt, **TIGHT).stats()["bytes_per_rank"]
    ((weights, kv),) = single
    with LLM(llama_ckpt, tensor_parallel_size=2, **TIGHT) as llm:
        ranks = llm.stats()["bytes_per_rank"]
        model = llm.engine.model
    assert len(ranks) == 2
    # Norm weights are replicated (hidden_size fp32 values: 2 per layer and the final one);
    # everything else is split in two.
    norms = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
    for rank_weights, rank_kv in ranks:
        assert rank_kv * 2 == kv
        assert rank_weights == (weights - norms) // 2 + norms
    print(f"TP=1: {weights} weight bytes, {kv} KV bytes; TP=2 per rank: {ranks}")


def test_fp8_build_splits_the_same(fp8_build):
    """FP8 rounds activations to a coarse grid, so fp32-level differences in summation
    order (any batch change does this too, on one rank) can move a value to the next
    FP8 step: compared here one prefill step per prompt, on logprobs, not long greedy runs."""
    ckpt = os.path.join(fp8_build, "checkpoint")
    prompts = random_prompts(8, [5, 40, 17, 90], vocab=4000, seed=3)
    fp8 = dict(block_size=4, num_kv_blocks=200, kv_cache_dtype="fp8", dtype="float32")
    first = SamplingParams(max_tokens=1, temperature=0, logprobs=5)

    def run(llm):
        return [llm.generate([p], first)[0] for p in prompts]

    expected = run(LLM(ckpt, **fp8))
    with LLM(ckpt, tensor_parallel_size=2, **fp8) as llm:
        got = run(llm)
        assert_pool_free(llm)
    worst = 0.0
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids
        top = e.logprobs[0]
        worst = max(worst, max(abs(g.logprobs[0][t].logprob - top[t].logprob) for t in top if t in g.logprobs[0]))
        assert set(top) == set(g.logprobs[0])
    print(f"FP8, TP=2 vs TP=1: largest top-5 logprob difference {worst:.2e}")
    assert worst < 0.02


def test_decode_graph_steps_reach_every_rank(ckpt_dir):
    """Rank 0 replaying decode graphs (the CPU stand-in: the forward over the static
    buffers a capture records, Triton kernels in the interpreter) sends each step's graph
    size and padded inputs; the other rank runs the same padded step in lockstep."""
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    prompts = random_prompts(5, [1, 30, 9, 23, 17], seed=3)
    expected = hf_greedy(path, prompts, 6)
    with LLM(path, tensor_parallel_size=2, block_size=8, num_kv_blocks=40, max_num_seqs=6,
             max_num_batched_tokens=32, attention_backend="triton", dtype="float32") as llm:
        runner = llm.engine.runner
        runner.graphs = EagerReplayGraphs(runner, 6)
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, min_tokens=6, temperature=0))
        assert [o.token_ids for o in outs] == expected
        assert (6, 1) in runner.graphs.replayed            # 5 sequences padded to 6 (GraphShape(6))
        assert_pool_free(llm)


def test_graphs_are_kept_only_if_every_rank_captured(llama_ckpt):
    """Rank 0 'captures' (a stand-in); rank 1 cannot (no CUDA here): every rank runs eagerly."""
    with LLM(llama_ckpt, tensor_parallel_size=2, block_size=4, num_kv_blocks=64, max_num_seqs=4) as llm:
        runner = llm.engine.runner
        assert llm.engine.workers.capture_graphs(lambda: EagerReplayGraphs(runner, 4), 4, 256) is None
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, min_tokens=4, temperature=0))[0]
        assert out.token_ids == hf_greedy(llama_ckpt, [[5, 6, 7]], 4)[0]


def _tp_loop(path):
    engine = LLMEngine(EngineArgs.create(model=path, tensor_parallel_size=2, block_size=4, num_kv_blocks=200,
                                         max_num_seqs=8, max_num_batched_tokens=32))
    return engine, EngineLoop(engine).start()


def test_a_killed_rank_fails_every_request_in_flight(llama_ckpt):
    engine, loop = _tp_loop(llama_ckpt)
    try:
        long = SamplingParams(max_tokens=300, min_tokens=300, temperature=0)
        streams = [loop.add_request(p, long, f"k{i}") for i, p in enumerate(random_prompts(4, [20], seed=4))]
        first = iter(streams[0])
        next(first)                                   # generation is under way
        os.kill(engine.workers.procs[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        finals = [list(first)[-1]] + [list(s)[-1] for s in streams[1:]]
        assert time.monotonic() - t0 < 10
        for out in finals:
            assert isinstance(out.error, EngineDeadError) and "rank 1" in str(out.error)
        assert not loop.is_alive
        late = list(loop.add_request([5, 6], GREEDY, "late"))
        assert isinstance(late[-1].error, EngineDeadError)
        assert_pool_free(engine)
    finally:
        loop.stop()
        engine.shutdown()


def test_a_rank_killed_while_idle_is_noticed_without_traffic(llama_ckpt):
    engine, loop = _tp_loop(llama_ckpt)
    try:
        assert list(loop.add_request([5, 6, 7], GREEDY, "ok"))[-1].finish_reason == "length"
        proc = engine.workers.procs[0]
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while loop.is_alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not loop.is_alive
        assert f"rank 1 (pid {proc.pid}) exited with code -9" in str(loop.error)
    finally:
        loop.stop()
        engine.shutdown()
    assert not any(p.is_alive() for p in engine.workers.procs)


def test_shutdown_stops_every_rank(llama_ckpt):
    llm = LLM(llama_ckpt, tensor_parallel_size=2, block_size=4, num_kv_blocks=16)
    procs = list(llm.engine.workers.procs)
    llm.close()
    assert all(p.exitcode == 0 for p in procs)
