"""Async scheduling (EngineArgs.async_scheduling) changes when the host works, never what
a request gets: with it on and off, the same requests give the same tokens, text,
finish reasons and logprobs (greedy and seeded; penalties, min_tokens, stop ids, stop
strings, max_tokens, a grammar; with chunked prefill and preemption), and a cancelled
request ends the same way. Every run ends with the block pool free."""

import pytest

from backend import LLM, SamplingParams
from backend.config import ConfigError
from tests.conftest import assert_pool_free, random_prompts


def _params(tok_ids: list[int]) -> list[SamplingParams]:
    stop_id = tok_ids[3]
    return [
        SamplingParams(max_tokens=24, temperature=0),
        SamplingParams(max_tokens=30, temperature=0.8, seed=7, repetition_penalty=1.3, frequency_penalty=0.4),
        SamplingParams(max_tokens=20, temperature=0.9, seed=11, top_p=0.8, logprobs=3),
        SamplingParams(max_tokens=25, min_tokens=10, temperature=0, stop_token_ids=[stop_id]),
        SamplingParams(max_tokens=40, temperature=1.0, seed=3, presence_penalty=0.5, stop=["e", "a"]),
        SamplingParams(max_tokens=16, temperature=0, guided_json={"type": "object", "properties": {
            "n": {"type": "integer"}}, "required": ["n"]}),
        SamplingParams(max_tokens=1, temperature=0),
        SamplingParams(max_tokens=12, temperature=0.7, seed=5, min_p=0.1, logprobs=1),
    ]


def _run(path: str, async_scheduling: bool, **kw):
    llm = LLM(path, async_scheduling=async_scheduling, **kw)
    assert llm.engine.async_scheduling is async_scheduling
    prompts = ["The quick brown fox", "Once upon a time", "1, 2, 3,", "Hello", "A long prompt " * 12,
               "JSON:", "x", "The end"]
    params = _params(llm.tokenizer.encode("a b c d e"))
    outs = llm.generate(prompts, params)
    assert_pool_free(llm.engine)
    return [(o.token_ids, o.text, o.finish_reason,
             [{t: pytest.approx(lp.logprob, abs=1e-4) for t, lp in e.items()} for e in o.logprobs]
             if o.logprobs else None)
            for o in outs], llm.stats()


@pytest.mark.parametrize("kw", [
    dict(block_size=8, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=64),
    # A pool too small for all at once (preemption) and a budget that chunks prompts.
    dict(block_size=4, num_kv_blocks=24, max_num_seqs=8, max_num_batched_tokens=16),
], ids=["roomy", "preempting"])
def test_outputs_are_identical_with_and_without_async_scheduling(tiny_ckpt, kw):
    on, on_stats = _run(tiny_ckpt, True, **kw)
    off, _ = _run(tiny_ckpt, False, **kw)
    assert on == off            # (logprobs to 1e-4: a step's batch may differ by a finished row)
    finish = [f for _, _, f, _ in on]
    assert "stop" in finish and "length" in finish
    if kw["num_kv_blocks"] == 24:
        assert on_stats["num_preemptions"] > 0 and on_stats["num_chunked_prefills"] > 0


def test_cancellation_mid_stream_is_the_same(tiny_ckpt):
    """Aborted once 5 tokens were delivered: the final output holds those 5 (a step in
    flight when the abort came is dropped) and every block is free, on and off."""
    results = []
    for mode in (True, False):
        llm = LLM(tiny_ckpt, block_size=8, num_kv_blocks=64, async_scheduling=mode)
        engine = llm.engine
        keep = engine.add_request("Count: one two", SamplingParams(max_tokens=50, min_tokens=50, temperature=0))
        other = engine.add_request("Other", SamplingParams(max_tokens=8, temperature=0))
        got = []
        while len(got) < 5:
            got += [t for o in engine.step() if o.request_id == keep.request_id for t in o.new_token_ids]
        final = engine.abort_request(keep.request_id)
        assert final.finished and final.finish_reason == "abort" and final.token_ids == got
        rest = []
        while engine.has_unfinished_requests():
            rest += [o for o in engine.step() if o.request_id == keep.request_id]
        assert rest == []                                   # nothing after the final output
        assert_pool_free(engine)
        results.append((got, other.output_token_ids))
    assert results[0] == results[1]


def test_async_scheduling_is_off_where_it_would_not_be_exact(tiny_ckpt):
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    assert LLM(tiny_ckpt, num_kv_blocks=16).engine.async_scheduling
    assert not LLM(tiny_ckpt, num_kv_blocks=16, speculative_config=spec).engine.async_scheduling
    with pytest.raises(ConfigError, match="async_scheduling=true is not supported where speculative_config"):
        LLM(tiny_ckpt, num_kv_blocks=16, speculative_config=spec, async_scheduling=True)
