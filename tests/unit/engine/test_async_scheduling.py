"""Async scheduling (EngineArgs.async_scheduling) changes when the host works, never what
a request gets: with it on and off, the same requests give the same tokens, text,
finish reasons and logprobs (greedy and seeded; penalties, min_tokens, stop ids, stop
strings, max_tokens, a grammar; with chunked prefill and preemption; with n-gram and
draft-model speculation), and a cancelled request ends the same way. Every run ends with
the block pool free."""

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


def _speculation_mix(tok_ids: list[int]) -> list[SamplingParams]:
    """Requests that speculate (greedy, seeded, with stops and max_tokens) beside requests
    that cannot (logprobs, or speculation switched off), greedy and seeded."""
    return [
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0.8, seed=7, repetition_penalty=1.2),
        SamplingParams(max_tokens=20, temperature=0, logprobs=2),
        SamplingParams(max_tokens=28, temperature=0.9, seed=11, speculative_decoding=False, frequency_penalty=0.3),
        SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[tok_ids[2]], min_tokens=5),
        SamplingParams(max_tokens=1, temperature=0),
        SamplingParams(max_tokens=22, temperature=0, stop=["e t"]),
    ]


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "draft_same",
], ids=["ngram", "draft_model"])
def test_speculation_with_async_scheduling_is_identical_to_in_series(tiny_ckpt, spec):
    """With speculation and async scheduling, a request that may speculate sits out the
    step launched while its own is in flight, the others run every step. Tokens, text,
    finish reasons, logprobs and the proposals verified equal the engine in series,
    greedy and seeded (seeded: while the budget leaves every step its proposals, as here;
    a schedule that cuts a seeded request's proposals differently draws its random
    numbers differently, in either mode equally exact), and steps really overlap with
    verifications."""
    if spec == "draft_same":
        spec = {"method": "draft_model", "model": tiny_ckpt, "num_speculative_tokens": 3}
    prompts = ["the cat sat on the mat. the cat sat on the mat. the cat", "a b a b a b a b",
               "1, 2, 3, 1, 2, 3, 1,", "Hello hello hello", "the end. the end. the", "x", "once upon a time"]
    results, stats = [], []
    for mode in (True, False):
        llm = LLM(tiny_ckpt, speculative_config=spec, async_scheduling=mode, block_size=8, num_kv_blocks=256,
                  max_num_batched_tokens=48)
        engine = llm.engine
        assert engine.async_scheduling is mode
        overlapped = []
        launch = engine.runner.launch

        def recording(sched, prev=None):
            if prev is not None:       # a step launched while another is in flight
                overlapped.append(any(s.spec_token_ids for s in (*sched.scheduled, *prev.sched.scheduled)))
            return launch(sched, prev)
        engine.runner.launch = recording
        outs = llm.generate(prompts, _speculation_mix(llm.tokenizer.encode("a b c d")))
        assert_pool_free(engine)
        results.append([(o.token_ids, o.text, o.finish_reason,
                         [{t: pytest.approx(lp.logprob, abs=1e-4) for t, lp in e.items()} for e in o.logprobs]
                         if o.logprobs else None) for o in outs])
        stats.append({k: v for k, v in llm.stats().items() if k.startswith("spec_decode")})
        assert any(overlapped) is mode
    assert results[0] == results[1]
    assert stats[0] == stats[1] and stats[0]["spec_decode_num_drafts"] > 0
    if spec["method"] == "draft_model":     # (the tiny model's text defeats lookup: n-gram proposals are rejected)
        assert stats[0]["spec_decode_num_accepted_tokens"] > 0
    assert {f for _, _, f, _ in results[0]} >= {"stop", "length"}


@pytest.mark.cpu_async_default
def test_the_cpu_runs_steps_in_series_unless_asked(tiny_ckpt):
    """Nothing runs beside the host on the CPU: scheduling ahead there would only delay
    each first token by a step. Unset, the engine runs in series on the CPU (and ahead
    elsewhere where exact); `async_scheduling: true` still schedules ahead."""
    from backend.config import EngineArgs
    args = EngineArgs.create(model="m")
    assert args.use_async_scheduling and args.async_scheduling_on("cuda") and not args.async_scheduling_on("cpu")
    assert EngineArgs.create(model="m", async_scheduling=True).async_scheduling_on("cpu")
    assert not LLM(tiny_ckpt, block_size=8, num_kv_blocks=64).engine.async_scheduling
    assert LLM(tiny_ckpt, block_size=8, num_kv_blocks=64, async_scheduling=True).engine.async_scheduling


def test_async_scheduling_is_refused_where_it_would_not_be_exact():
    from backend.config import EngineArgs
    assert EngineArgs.create(model="m").use_async_scheduling
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    assert EngineArgs.create(model="m", speculative_config=ngram).use_async_scheduling
    draft = {"method": "draft_model", "model": "d", "num_speculative_tokens": 2}
    assert EngineArgs.create(model="m", speculative_config=draft).use_async_scheduling
    assert not EngineArgs.create(model="m", tensor_parallel_size=2).use_async_scheduling
    with pytest.raises(ConfigError, match="async_scheduling=true is not supported where tensor_parallel_size=2"):
        EngineArgs.create(model="m", tensor_parallel_size=2, async_scheduling=True)


def test_draft_catches_up_one_collected_step_at_a_time(tiny_ckpt):
    """A prompt chunked under a small budget: when its first chunk is collected, its last
    chunk is in flight and the request looks ready to propose. The draft catches up on
    the collected chunk only (it runs inside that step's collect, from the step as
    scheduled), not on both at once, past its buffers; tokens equal the engine in series."""
    spec = {"method": "draft_model", "model": tiny_ckpt, "num_speculative_tokens": 3}
    outs = []
    for mode in (True, False):
        llm = LLM(tiny_ckpt, speculative_config=spec, async_scheduling=mode, block_size=4, num_kv_blocks=64,
                  max_num_batched_tokens=10, max_num_seqs=8)
        outs.append(llm.generate([list(range(10, 31)), list(range(40, 53))],
                                 SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
        assert_pool_free(llm.engine)
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]


def test_a_verification_in_flight_when_its_request_is_aborted_still_counts_its_rejections(tiny_ckpt):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    engine = LLM(tiny_ckpt, speculative_config=spec, block_size=8, num_kv_blocks=256).engine
    r = engine.add_request("a b a b a b a b a b a b", SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    engine.add_request("x", SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, speculative_decoding=False))
    verifying = None
    for _ in range(200):
        engine.step()
        if engine._in_flight is not None:
            verifying = next((s for s in engine._in_flight.sched.scheduled
                              if s.request is r and s.spec_token_ids), None)
            if verifying is not None:
                break
    assert verifying is not None
    before = engine.stats()["spec_decode_num_accepted_tokens"]
    engine.abort_request(r.request_id)
    engine.step()                                   # collects the aborted request's verification
    accepted = engine.stats()["spec_decode_num_accepted_tokens"] - before
    # (the tiny model's text defeats lookup: its proposals are rejected)
    assert verifying.num_rejected > 0 and accepted == len(verifying.spec_token_ids) - verifying.num_rejected
    for request_id in list(engine.scheduler.requests):
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_free(engine)
