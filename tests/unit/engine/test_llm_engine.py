"""Engine behaviour through the offline API: batch invariance, prefix caching, aborts,
stop conditions and input errors. Every test ends with the block pool fully free."""

import pytest

from backend import LLM, InvalidRequestError, SamplingParams
from tests.conftest import assert_pool_free, random_prompts

GREEDY = SamplingParams(max_tokens=16, min_tokens=16, temperature=0)
SEEDED = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.9, top_k=50, top_p=0.9, seed=1234)


@pytest.fixture
def make_llm(llama_ckpt):
    made = []

    def make(**kw):
        args = dict(block_size=4, num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=64)
        args.update(kw)
        llm = LLM(llama_ckpt, **args)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        assert_pool_free(llm)


def _on_cpu_fp32(make):
    return lambda **kw: make(**{"device": "cpu", "dtype": "float32", **kw})


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_batch_invariance(make_llm, prefix_caching, params):
    """A request's tokens do not depend on its batch mates. Bit-exact only on the CPU in
    fp32 (set here): on CUDA, cuBLAS picks GEMM kernels by batch shape, so even fp32
    logits differ in the last bits with the batch and a near-tie can flip; the GPU-side
    promise is a tolerance (benchmarks/gpu_check.py compares graph and eager steps)."""
    make_llm = _on_cpu_fp32(make_llm)
    target = random_prompts(1, [37], seed=7)[0]
    alone = make_llm(enable_prefix_caching=prefix_caching).generate([target], params)[0].token_ids
    others = random_prompts(9, [5, 120, 64, 1, 80], seed=8)
    for mix_seed, pos in [(0, 0), (1, 4), (2, 9)]:
        batch = others[:pos] + [target] + others[pos:]
        llm = make_llm(enable_prefix_caching=prefix_caching, num_kv_blocks=90, seed=mix_seed)
        outs = llm.generate(batch, [params if i == pos else SEEDED.model_copy(update={"seed": i})
                                    for i in range(len(batch))])
        assert outs[pos].token_ids == alone
    # Sanity: seeded sampling is not accidentally greedy.
    if params is SEEDED:
        greedy = make_llm().generate([target], GREEDY)[0].token_ids
        assert greedy != alone


def test_prefix_cache_hits_and_identical_output(make_llm):
    prefix = random_prompts(1, [64], seed=3)[0]
    a, b = prefix + [11, 12, 13], prefix + [21, 22]
    ref = make_llm(enable_prefix_caching=False).generate([a, b], GREEDY)
    llm = make_llm(enable_prefix_caching=True)
    first = llm.generate([a], GREEDY)[0]
    hits_before = llm.stats()["prefix_cache_hit_tokens"]
    second = llm.generate([b], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 64
    assert llm.stats()["prefix_cache_hit_tokens"] - hits_before == 64
    assert [first.token_ids, second.token_ids] == [ref[0].token_ids, ref[1].token_ids]


def test_fully_cached_prompt_still_computes_last_token(make_llm):
    prompt = random_prompts(1, [32], seed=4)[0]  # block aligned
    llm = make_llm()
    first = llm.generate([prompt], GREEDY)[0]
    again = llm.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == 28
    assert again.token_ids == first.token_ids


def test_abort_frees_blocks_at_once(make_llm):
    llm = make_llm()
    engine = llm.engine
    reqs = [engine.add_request(p, GREEDY) for p in random_prompts(4, [30, 50], seed=5)]
    engine.step()
    engine.step()
    assert engine.stats()["num_used_blocks"] > 0
    for r in reqs[:2]:
        out = engine.abort_request(r.request_id)
        assert out.finished and out.finish_reason == "abort"
    assert engine.abort_request(reqs[0].request_id) is None  # twice is harmless
    # Waiting requests can be aborted too.
    waiting = engine.add_request([5, 6, 7], GREEDY)
    engine.abort_request(waiting.request_id)
    while engine.has_unfinished_requests():
        engine.step()


def test_stop_conditions(make_llm):
    llm = make_llm()
    prompt = random_prompts(1, [10], seed=6)[0]
    free_run = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    toks = free_run.token_ids
    stop_tok = toks[5]
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                stop_token_ids=[stop_tok]))[0]
    assert out.finish_reason == "stop" and out.token_ids == toks[:toks.index(stop_tok) + 1]
    # min_tokens holds the stop token back until reached.
    later = toks.index(stop_tok) + 1
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                stop_token_ids=[stop_tok], min_tokens=later + 1))[0]
    assert len(out.token_ids) > later
    out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.finish_reason in ("length", "stop") and len(out.token_ids) <= 3


def test_eos_stops_unless_ignored(llama_ckpt, make_llm):
    llm = make_llm()
    prompt = random_prompts(1, [10], seed=6)[0]
    toks = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    eos = toks[3]  # pretend this output token is the EOS
    object.__setattr__(llm.engine.model_config, "eos_token_ids", (eos,))
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos and len(out.token_ids) == toks.index(eos) + 1
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == toks


def test_input_errors(make_llm):
    llm = make_llm(max_model_len=100)
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        llm.generate(["hello"])
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]])
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[1, 99999]])
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.generate([[3] * 100])
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        llm.generate([[3] * 90], SamplingParams(max_tokens=20))
    # Nothing was left half-added, and the engine still serves.
    assert llm.generate([[3, 4, 5]], GREEDY)[0].finish_reason == "length"


def test_max_tokens_none_runs_to_max_model_len(make_llm):
    llm = make_llm(max_model_len=40)
    out = llm.generate([[3] * 30], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_text_prompts_with_tokenizer(tiny_ckpt):
    llm = LLM(tiny_ckpt, block_size=16, num_kv_blocks=64)
    out = llm.generate("The assert statement", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    tok = llm.tokenizer
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    assert out.num_prompt_tokens == len(tok.encode("The assert statement"))
    assert_pool_free(llm)


def test_stop_string_cuts_text(tiny_ckpt):
    llm = LLM(tiny_ckpt, block_size=16, num_kv_blocks=64)
    base = llm.generate("x = 1", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    stop = base.text[10:13]
    assert stop.strip(), base.text
    out = llm.generate("x = 1", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == base.text[:base.text.index(stop)]
    out = llm.generate("x = 1", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=stop,
                                                include_stop_str_in_output=True))[0]
    assert out.text == base.text[:base.text.index(stop) + len(stop)]
    assert_pool_free(llm)


def test_an_engine_is_freed_when_its_last_reference_goes(llama_ckpt, tmp_path):
    """No reference cycle through the engine's parts, with every optional part on: the
    engine freezes the heap (gc_policy.py), so a cycle would keep a dropped engine, its
    model and its KV pool for the life of the process (a sleep-mode back-reference did:
    CI's lanes ran out of memory)."""
    import weakref
    llm = LLM(llama_ckpt, block_size=4, num_kv_blocks=16, enable_lora=True, kv_offloading_size=0.001,
              scheduling_policy="priority", priority_aging_s=5.0,
              kv_events_config={"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0"})
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=2))
    ref = weakref.ref(llm.engine)
    llm.engine.shutdown()
    del llm
    assert ref() is None
