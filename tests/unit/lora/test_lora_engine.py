"""Greedy output under LoRA adapters equals transformers + PEFT (`PeftModel`) token for
token (fp32, CPU: the promise holds in fp32), whatever the batch mixes: three adapters
and the base model, chunked prefill, preemption, adapter slots evicted and reloaded.
The engine's adapters are PEFT's own files (tests/helpers/adapters.py)."""

import pytest

from backend import LLM, SamplingParams
from backend.engine.errors import InvalidRequestError
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.adapters import make_adapter, peft_greedy
from tests.helpers.checkpoints import make_checkpoint

MAX_NEW = 10
LENGTHS = [1, 37, 5, 60, 12, 23, 90, 3]
NAMES = [None, "all", "qv", "mlp"]


@pytest.fixture(scope="module")
def base(ckpt_dir):
    return make_checkpoint(str(ckpt_dir / "llama"), "llama")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return {"all": make_adapter(base, str(root / "all"), rank=8, alpha=16, seed=1),
            "qv": make_adapter(base, str(root / "qv"), rank=4, alpha=8, targets=("q_proj", "v_proj"), seed=2,
                               rslora=True),
            "mlp": make_adapter(base, str(root / "mlp"), rank=16, alpha=32,
                                targets=("gate_proj", "up_proj", "down_proj"), seed=3)}


@pytest.fixture(scope="module")
def reference(base, adapters):
    """Per adapter (None: the base model), transformers' greedy tokens for every prompt."""
    prompts = random_prompts(len(LENGTHS), LENGTHS, seed=4)
    refs = {name: peft_greedy(base, adapters.get(name), prompts, MAX_NEW) for name in NAMES}
    assert len({str(r) for r in refs.values()}) == len(NAMES)      # every adapter changes the output
    return prompts, refs


def params(name, n=MAX_NEW):
    """Greedy, n tokens (EOS masked, as the reference's min_new_tokens): the first n of it."""
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0, lora_name=name)


def record_steps(llm):
    """The distinct adapters of every step, as the runner hands them to the LoRA manager."""
    seen = []
    prepare = llm.engine.lora.prepare

    def spy(names, num_new_tokens, graph_size=None):
        seen.append(set(names) - {None})
        seen_stats.append(llm.stats())
        prepare(names, num_new_tokens, graph_size)
    seen_stats = llm.lora_stats_seen = []
    llm.engine.lora.prepare = spy
    return seen


@pytest.mark.parametrize("max_loras", [3, 2])
def test_mixed_adapters_equal_peft(base, adapters, reference, max_loras, monkeypatch):
    """Each request gets the tokens PEFT gives it alone. max_loras=3: the three adapters
    and the base model share steps. max_loras=2 (and 2 in host memory): the scheduler
    keeps each step within two adapters, slots are evicted and reloaded, adapters are
    read again from their folders. The torch path's two forms: all slots at once
    (max_loras=3), slot by slot (2)."""
    from backend.lora import punica
    monkeypatch.setattr(punica, "DENSE_MAX_ROWS", 64 if max_loras == 3 else 0)
    monkeypatch.setattr(punica, "DENSE_MIN_ADAPTERS", 1)
    prompts, refs = reference
    names = [NAMES[i % len(NAMES)] for i in range(len(prompts))]
    llm = LLM(base, block_size=4, num_kv_blocks=40, max_num_seqs=8, max_num_batched_tokens=32,
              lora_modules=adapters, max_loras=max_loras, max_cpu_loras=max_loras, max_lora_rank=16)
    steps = record_steps(llm)
    # A second round with the adapters in the other order brings evicted ones back.
    for order in (names, names[::-1]):
        outs = llm.generate(prompts, [params(n) for n in order])
        for i, (out, name) in enumerate(zip(outs, order)):
            assert out.token_ids == refs[name][i], f"prompt {i} under {name}"
    assert max(len(s) for s in steps) == max_loras          # steps were shared, up to the limit
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0
    # What vllm:lora_requests_info shows: the adapters of running and waiting requests.
    assert stats["running_lora_adapters"] == stats["waiting_lora_adapters"] == [] and stats["max_loras"] == max_loras
    running = [set(s["running_lora_adapters"]) for s in llm.lora_stats_seen]
    assert {"all", "qv", "mlp"} in running or max_loras == 2
    assert all(len(r) <= max_loras for r in running)
    if max_loras == 2:  # an adapter waited for a slot while two others ran
        assert any(len(s["running_lora_adapters"]) == 2 and set(s["waiting_lora_adapters"]) - set(s["running_lora_adapters"])
                   for s in llm.lora_stats_seen)
    lora = llm.engine.lora
    if max_loras == 2:
        assert lora.num_slot_loads > 3 and lora.num_host_loads > 0
    assert_pool_free(llm)


def test_prefix_cache_is_keyed_by_adapter(base, adapters, reference):
    """The same prompt under adapter A, B, the base model, then A again: only the last
    finds cached blocks (A's), and every output is still PEFT's."""
    prompts, refs = reference
    i = LENGTHS.index(60)
    llm = LLM(base, block_size=4, num_kv_blocks=200, lora_modules=adapters, max_loras=1)
    cached = []
    for name in ["all", "qv", None, "mlp", "all", None]:
        out = llm.generate([prompts[i]], params(name))[0]
        assert out.token_ids == refs[name][i], name
        cached.append(out.num_cached_tokens)
    assert cached == [0, 0, 0, 0, 56, 56]
    assert_pool_free(llm)


def test_triton_kernels_in_the_engine(base, adapters, reference):
    """The SGMV Triton kernels (interpreter on CPU) with the Triton attention: PEFT's tokens
    in a batch of two adapters and the base model."""
    prompts, refs = reference
    pick = [0, 2, 4]
    names = [None, "qv", "all"]
    llm = LLM(base, block_size=8, num_kv_blocks=32, attention_backend="triton", lora_modules=adapters,
              max_loras=2)
    outs = llm.generate([prompts[i] for i in pick], [params(n, 4) for n in names])
    assert [o.token_ids for o in outs] == [refs[n][i][:4] for n, i in zip(names, pick)]
    assert_pool_free(llm)


def test_unknown_adapter_is_a_per_request_error(base, adapters):
    llm = LLM(base, block_size=4, num_kv_blocks=32, lora_modules=adapters)
    with pytest.raises(InvalidRequestError, match=r"LoRA nope is not supported, we currently support \['all', 'qv', "
                                                  r"'mlp'\]"):
        llm.engine.add_request([5, 6, 7], params("nope"))
    assert llm.generate([[5, 6, 7]], params("qv"))[0].finish_reason == "length"     # still serving
    plain = LLM(base, block_size=4, num_kv_blocks=32)
    with pytest.raises(InvalidRequestError, match="'lora_name' is 'qv', but LoRA is not enabled"):
        plain.engine.add_request([5, 6, 7], params("qv"))
    assert_pool_free(llm)


def test_speculative_decoding_under_adapters(base, adapters, reference):
    """n-gram proposals are verified by the target under each request's adapter: still
    PEFT's tokens, with proposals accepted along the way."""
    prompts, refs = reference
    names = [NAMES[i % len(NAMES)] for i in range(len(prompts))]
    llm = LLM(base, block_size=4, num_kv_blocks=128, lora_modules=adapters, max_loras=3,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 2})
    outs = llm.generate(prompts, [params(n) for n in names])
    for i, (out, name) in enumerate(zip(outs, names)):
        assert out.token_ids == refs[name][i], f"prompt {i} under {name}"
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0
    assert_pool_free(llm)


def test_decode_graph_path_with_adapters(base, adapters, reference):
    """Decode steps through the CUDA-graph path (its CPU stand-in: fixed buffers, padded
    batches, the LoRA kernels reading their row groups from the views a capture records):
    PEFT's tokens for two adapters and the base model."""
    from tests.helpers.graphs import EagerReplayGraphs
    prompts, refs = reference
    pick, names = [0, 2, 4], [None, "all", "qv"]
    llm = LLM(base, block_size=8, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
              attention_backend="triton", lora_modules=adapters, max_loras=2)
    runner = llm.engine.runner
    runner.graphs = EagerReplayGraphs(runner, 4)
    outs = llm.generate([prompts[i] for i in pick], [params(n, 5) for n in names])
    assert [o.token_ids for o in outs] == [refs[n][i][:5] for n, i in zip(names, pick)]
    assert (4, 1) in runner.graphs.replayed             # three sequences padded to four (GraphShape(4))
    assert_pool_free(llm)
