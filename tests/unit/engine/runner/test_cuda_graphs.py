"""CUDA-graph decode, the parts a CPU can check: the size ladder, bucket choice, which
steps qualify, padded inputs in the fixed buffers, the check against eager, and the
whole engine serving through the graph path with a stand-in graph that recomputes over
exactly the buffers a captured graph reads (Triton kernels, interpreter)."""

import logging

import numpy as np
import pytest
import torch

from backend import LLM, SamplingParams
from backend.engine.runner.cuda_graphs import (DecodeGraphs, _check_against_eager, capture_decode_graphs, capture_sizes,
                                        estimate_graph_bytes, graph_ladders, graph_pool_bytes, graph_size_for,
                                        needs_query_len)
from backend.engine.runner.step_inputs import GraphShape
from backend.engine.scheduling.sched_output import ScheduledRequest, SchedulerOutput
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import hf_greedy, make_checkpoint
from tests.helpers.graphs import EagerReplayGraphs


def test_capture_sizes_ladder():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1) == [1]


def test_smallest_graph_that_fits():
    sizes = capture_sizes(64)
    assert [graph_size_for(n, sizes) for n in (1, 3, 8, 9, 17, 64)] == [1, 4, 8, 16, 32, 64]
    assert graph_size_for(65, sizes) is None


class _Req:
    def __init__(self, computed, total):
        self.num_computed_tokens, self.num_tokens = computed, total
        self.num_output_placeholders = 0
        self.request_id, self.mm_inputs = "r", None


def test_steps_whose_requests_all_sample_qualify():
    decode = SchedulerOutput([ScheduledRequest(_Req(9, 10), 1), ScheduledRequest(_Req(0, 1), 1)])
    chunk = SchedulerOutput([ScheduledRequest(_Req(9, 10), 1), ScheduledRequest(_Req(0, 40), 1)])
    prefill = SchedulerOutput([ScheduledRequest(_Req(9, 10), 1), ScheduledRequest(_Req(0, 5), 5)])
    assert needs_query_len(decode) == 1
    assert needs_query_len(chunk) is None and needs_query_len(SchedulerOutput()) is None
    # A whole 5-token prompt samples too: a graph of 5 tokens per row could serve it
    # (the decode ladder cannot; a verify ladder of k + 1 >= 5 would).
    assert needs_query_len(prefill) == 5 and DecodeGraphs(capture_sizes(4)).size_for(prefill) is None


def test_verify_steps_take_the_verify_ladder():
    """Issue 28 part 5: with speculation (k = 2) a second ladder of 3 tokens per row, as
    far as the step buffers hold (128 tokens: 42 rows); a step whose requests all sample
    and add at most 3 tokens replays it, a prompt chunk or a longer row runs eagerly."""
    graphs = graph_ladders(64, 3, 128)
    assert graphs.sizes == [1, 2, 4, 8, 16, 32, 48, 64] and graphs.verify_sizes == [1, 2, 4, 8, 16, 32, 42]
    assert GraphShape(42, 3) in graphs.shapes and GraphShape(48, 3) not in graphs.shapes
    verify = SchedulerOutput([ScheduledRequest(_Req(9, 10), 3), ScheduledRequest(_Req(4, 5), 1),
                              ScheduledRequest(_Req(6, 7), 2)])
    assert needs_query_len(verify) == 3 and graphs.size_for(verify) == GraphShape(4, 3)
    assert graphs.size_for(SchedulerOutput([ScheduledRequest(_Req(9, 10), 1)] * 3)) == GraphShape(4, 1)
    too_long = SchedulerOutput([ScheduledRequest(_Req(9, 10), 4)])
    chunk = SchedulerOutput([ScheduledRequest(_Req(9, 10), 3), ScheduledRequest(_Req(0, 40), 3)])
    assert graphs.size_for(too_long) is None and graphs.size_for(chunk) is None
    assert graph_ladders(64, 0, 128).verify_sizes == []       # no speculation: decode graphs only


def test_engine_through_verify_graphs_matches_transformers(ckpt_dir):
    """n-gram speculation with the verify ladder (a stand-in replay over the fixed buffers,
    Triton kernels under the interpreter): the greedy tokens of transformers, verify steps
    served by graphs of 3 tokens per row, padded tokens writing nothing."""
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [12, 13] * 6 + [14]]
    expected = hf_greedy(path, prompts, 10)
    llm = LLM(path, block_size=8, num_kv_blocks=40, max_num_seqs=4, max_num_batched_tokens=32,
              attention_backend="triton", speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                              "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    runner = llm.engine.runner
    runner.graphs = EagerReplayGraphs(runner, 4, verify_query_len=3)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, min_tokens=10, temperature=0))
    assert [o.token_ids for o in outs] == expected
    assert any(shape.query_len == 3 for shape in runner.graphs.replayed)
    assert llm.engine.stats()["spec_decode_num_draft_tokens"] > 0
    assert_pool_free(llm)


@pytest.mark.parametrize("draft", ["same", "other"])
def test_draft_model_through_its_own_graphs(ckpt_dir, draft):
    """The draft model's forwards replay graphs of its own (stand-ins over the draft's
    fixed buffers, Triton kernels under the interpreter): one-token proposals its decode
    ladder, a catch-up of up to k + 1 tokens a row its verify ladder. Greedy output stays
    transformers'. A draft equal to the target proposes exactly the target's tokens
    (every proposal accepted); another draft proposes exactly what it proposes eagerly.
    Proposals are verified, so the output alone could not show a wrong draft forward."""
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    other = make_checkpoint(str(ckpt_dir / "llama_draft_graphs"), "llama", seed=7, num_hidden_layers=1,
                            hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    prompts = random_prompts(3, [1, 30, 9], seed=2)       # (3 rows: a graph of 4 pads one)
    expected = hf_greedy(path, prompts, 9)
    params = SamplingParams(max_tokens=9, min_tokens=9, temperature=0)
    spec = {"method": "draft_model", "model": path if draft == "same" else other, "num_speculative_tokens": 3}
    engine = dict(block_size=8, num_kv_blocks=40, max_num_seqs=4, max_num_batched_tokens=32,
                  attention_backend="triton", speculative_config=spec)
    runs = {}
    for graphs in (False, True):
        llm = LLM(path, **engine)
        proposer = llm.engine.runner.drafter
        if graphs:
            # What capture_decode_graphs asks of the proposer: its check against eager
            # (one graph of each ladder), over the draft's buffers, which serve on after it.
            one_row = EagerReplayGraphs(proposer, 1, verify_query_len=4)
            assert _check_against_eager(one_row, proposer, np.random.default_rng(0),
                                        {shape: 2 for shape in one_row.shapes}) is None
            proposer.graphs = EagerReplayGraphs(proposer, 4, verify_query_len=4)
            _poison_before_each_build(proposer.inputs, 40 * 8)
        proposals = []
        real = proposer.propose

        def propose(sched, states, sampled, target_hidden=None, paths=None, real=real, proposals=proposals):
            result = real(sched, states, sampled, target_hidden, paths)
            proposals.append(sorted((rid, tokens) for rid, (tokens, _) in result.tokens.items()))
            return result
        proposer.propose = propose
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == expected
        assert_pool_free(llm)
        runs[graphs] = (proposals, llm.stats())
    replayed = proposer.graphs.replayed
    assert any(s.query_len == 1 for s in replayed), replayed
    if draft == "same":     # all accepted: a catch-up is the k + 1 tokens that landed (the verify ladder)
        assert any(s.query_len == 4 for s in replayed), replayed
    # Same proposals, step by step (request ids differ between the engines only in name).
    strip = [[tokens for _, tokens in step] for step in runs[False][0]]
    assert [[tokens for _, tokens in step] for step in runs[True][0]] == strip and any(strip)
    if draft == "same":
        assert runs[True][1]["spec_decode_acceptance_rate"] == 1.0


def _poison_before_each_build(builder, num_slots: int) -> None:
    """Before each step is built, fill the per-token inputs (host and device, every
    entry) with tokens that write real slots: a replay that read past what its step
    wrote (a padding row or token left stale) would corrupt the cache."""
    rng = np.random.default_rng(0)
    real = builder.build_segments

    def build_segments(*args, **kwargs):
        for name, high in (("input_ids", 64), ("positions", 16), ("slot_mapping", num_slots)):
            values = rng.integers(0, high, builder.T)
            builder._host(name, builder.T)[:] = values
            builder.device_view(name, builder.T).copy_(torch.from_numpy(values))
        return real(*args, **kwargs)
    builder.build_segments = build_segments


def test_graph_memory_is_reserved_in_the_plan(llama_ckpt):
    from backend.models.config import load_model_config
    cfg = load_model_config(llama_ckpt)
    small, big = estimate_graph_bytes(cfg, 8, 2), estimate_graph_bytes(cfg, 64, 2)
    assert 0 < small < big and big >= 64 * cfg.vocab_size * 2
    # A ladder's pool: the largest graph's intermediates, and every graph's logits (each
    # stays allocated as its output): 1 + 2 + 4 + 8 + 16 + 32 + 48 rows beside the 64.
    ladder = graph_ladders(64, 0, 64).shapes
    assert graph_pool_bytes(cfg, ladder, 2) == big + 111 * cfg.vocab_size * (2 + 4)
    assert graph_pool_bytes(cfg, [GraphShape(64)], 2) == big
    # Each graph's hidden states kept for an EAGLE-3 head: 3 x hidden per row of every graph.
    width = 3 * cfg.hidden_size
    assert graph_pool_bytes(cfg, ladder, 2, width) - graph_pool_bytes(cfg, ladder, 2) == (111 + 64) * width * 2


def test_engine_through_padded_graph_path_matches_transformers(ckpt_dir):
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    prompts = random_prompts(5, [1, 30, 9, 23, 17], seed=3)
    expected = hf_greedy(path, prompts, 6)
    llm = LLM(path, block_size=8, num_kv_blocks=40, max_num_seqs=6, max_num_batched_tokens=32,
              attention_backend="triton")
    runner = llm.engine.runner
    runner.graphs = EagerReplayGraphs(runner, 6)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, min_tokens=6, temperature=0))
    assert [o.token_ids for o in outs] == expected
    assert GraphShape(8) not in runner.graphs.replayed and GraphShape(6) in runner.graphs.replayed   # 5 padded to 6
    assert_pool_free(llm)


def test_padded_inputs_overwrite_stale_rows(llama_ckpt):
    llm = LLM(llama_ckpt, block_size=4, num_kv_blocks=64, max_num_seqs=8, enforce_eager=True)
    engine = llm.engine
    b = engine.runner.inputs
    for p in random_prompts(8, [3, 6], seed=0):
        engine.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()                                   # an 8-sequence prefill fills the buffers
    for rid in list(engine.scheduler.requests)[:3]:
        engine.abort_request(rid)
    sched = engine.scheduler.schedule()
    assert len(sched.scheduled) == 5 and needs_query_len(sched) == 1
    addresses = [b.device_view(n, 1).data_ptr() for n in b.offsets]
    step = b.build(sched, engine.runner.update_states(sched), pad_to=GraphShape(8))
    assert [b.device_view(n, 1).data_ptr() for n in b.offsets] == addresses
    dev = {n: b.device_view(n, 9).cpu().numpy() for n in ("slot_mapping", "seq_lens", "query_start_loc", "input_ids")}
    assert (dev["slot_mapping"][5:8] == -1).all() and (dev["slot_mapping"][:5] >= 0).all()
    assert (dev["seq_lens"][5:8] == 0).all() and (dev["input_ids"][5:8] == 0).all()
    assert dev["query_start_loc"].tolist() == [0, 1, 2, 3, 4, 5, 5, 5, 5]
    assert step.num_seqs == 5 and step.input_ids.shape[0] == 8
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    assert_pool_free(engine)


def test_graph_disagreeing_with_eager_is_refused(llama_ckpt):
    llm = LLM(llama_ckpt, block_size=4, num_kv_blocks=16, max_num_seqs=4, attention_backend="triton")
    runner = llm.engine.runner

    class Wrong(EagerReplayGraphs):
        def replay(self, shape):
            return super().replay(shape).flip(0) if shape.num_seqs > 1 else super().replay(shape)
    rng = np.random.default_rng(0)
    graphs = EagerReplayGraphs(runner, 4, verify_query_len=3)
    splits = {s: 2 for s in graphs.shapes}
    assert _check_against_eager(graphs, runner, rng, splits) is None
    msg = _check_against_eager(Wrong(runner, 4), runner, rng, splits)
    assert msg is not None and "batch size 2" in msg

    class WrongVerify(EagerReplayGraphs):
        def replay(self, shape):
            logits = super().replay(shape)
            return logits.flip(0) if shape == GraphShape(2, 3) else logits
    msg = _check_against_eager(WrongVerify(runner, 4, verify_query_len=3), runner, rng, splits)
    assert msg is not None and "verify (3 tokens per row), batch size 2" in msg


def test_capture_failure_leaves_the_engine_eager(llama_ckpt, caplog):
    llm = LLM(llama_ckpt, block_size=4, num_kv_blocks=16, max_num_seqs=4, device="cpu")
    assert not llm.engine.use_cuda_graphs and llm.engine.runner.graphs is None   # CPU: never captured
    with caplog.at_level(logging.WARNING):
        assert capture_decode_graphs(llm.engine.runner, 4, 64) is None          # a CPU runner cannot capture
    assert "running eagerly" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures real CUDA graphs")
def test_captured_graphs_serve_the_eager_tokens(llama_ckpt):
    """On a GPU: fp32, TF32 off; graphs and enforce_eager give the same greedy tokens."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = random_prompts(7, [3, 40, 17], seed=5)
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)
    runs = []
    for eager in (False, True):
        llm = LLM(llama_ckpt, dtype="float32", device="cuda", block_size=8, num_kv_blocks=64, max_num_seqs=8,
                  attention_backend="triton", enforce_eager=eager)
        assert (llm.engine.runner.graphs is None) == eager
        runs.append([o.token_ids for o in llm.generate(prompts, params)])
        assert_pool_free(llm)
    assert runs[0] == runs[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures real CUDA graphs")
def test_the_draft_models_captured_graphs_propose_the_targets_tokens(llama_ckpt):
    """On a GPU: fp32, TF32 off; a draft equal to the target, with CUDA graphs of its own,
    proposes what the target samples (near-ties aside, every proposal accepted), and the
    output equals enforce_eager's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = random_prompts(7, [3, 40, 17], seed=5)
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)
    spec = {"method": "draft_model", "model": llama_ckpt, "num_speculative_tokens": 3}
    runs = []
    for eager in (False, True):
        llm = LLM(llama_ckpt, dtype="float32", device="cuda", block_size=8, num_kv_blocks=64, max_num_seqs=8,
                  attention_backend="triton", enforce_eager=eager, speculative_config=spec)
        drafter = llm.engine.runner.drafter
        assert (drafter.graphs is None) == eager
        runs.append([o.token_ids for o in llm.generate(prompts, params)])
        assert llm.stats()["spec_decode_acceptance_rate"] > 0.9
        assert_pool_free(llm)
    assert runs[0] == runs[1]
