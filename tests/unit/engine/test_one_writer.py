"""One writer (issue 28 part 1): while an engine serves with every feature on, request
state is written only from the scheduler's side: the scheduler (scheduler.py and the
modules its class spans: its priority step, its write of a step's result, its
speculation share) and the helpers it owns (the stop checks, the structured-output
manager, the KV cache manager). Every attribute write and every change to a request's lists is recorded with
the file that made it; the runner, the proposers, the sampler, the output side and the
engine's intake (past construction) must not appear."""

import sys

import pytest

from backend import LLM, SamplingParams
from backend.engine.request import Request
from tests.conftest import assert_pool_free, random_prompts

SCHEDULER_SIDE = {"scheduler.py", "priority_admission.py", "step_results.py", "proposal_slots.py", "stop_checker.py",
                  "grammar.py", "structured_output_manager.py", "kv_cache_manager.py"}


def _caller(depth: int) -> str:
    return sys._getframe(depth).f_code.co_filename.rsplit("/", 1)[-1]


class _Watched(list):
    """A request's list that records who changes it."""
    writers: set = set()

    def _record(self):
        _Watched.writers.add(_caller(3))


for _name in ("append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse",
              "__setitem__", "__delitem__", "__iadd__"):
    def _wrap(name=_name):
        real = getattr(list, name)

        def method(self, *args):
            self._record()
            return real(self, *args)
        return method
    setattr(_Watched, _name, _wrap())


@pytest.fixture
def watch_writes(monkeypatch):
    """The set of files that wrote request state after the request was built."""
    writers: set = set()
    _Watched.writers = writers
    real = object.__setattr__

    def watched(self, name, value):
        frame = sys._getframe(1)
        building = frame.f_code.co_name == "__init__" and frame.f_code.co_filename == "<string>"
        if not building:
            writers.add(_caller(2))
        if type(value) is list:
            value = _Watched(value)
        real(self, name, value)
    monkeypatch.setattr(Request, "__setattr__", watched)
    return writers


def test_only_the_scheduler_side_writes_requests_with_every_feature_on(tiny_ckpt, watch_writes):
    """n-gram speculation, async scheduling, preemption (a pool too small for the batch),
    chunked prefill, n = 2, penalties, logprobs, stop strings, a JSON schema."""
    # 40 blocks: preemption whatever the guided request's grammar takes to compile (with 60,
    # a test run alone on a quiet machine saw none: the guided request joined late).
    llm = LLM(tiny_ckpt, block_size=4, num_kv_blocks=40, max_num_seqs=8, max_num_batched_tokens=40,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                  "prompt_lookup_min": 1})
    assert llm.engine.async_scheduling
    prompts = random_prompts(6, [30, 45, 12], vocab=300, seed=4)
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, seed=1, n=2, repetition_penalty=1.2,
                             frequency_penalty=0.3, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0, logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0, stop=["e"], ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0, guided_json={"type": "object"}),
              SamplingParams(max_tokens=24, temperature=0, min_tokens=5, ignore_eos=True)]
    outs = llm.generate(prompts, params)
    assert len(outs) == len(prompts) and all(o.token_ids for o in outs)
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0 and stats["num_preemptions"] > 0, stats
    assert "scheduler.py" in watch_writes
    assert watch_writes <= SCHEDULER_SIDE, watch_writes - SCHEDULER_SIDE
    assert_pool_free(llm)


def test_only_the_scheduler_side_writes_requests_with_a_draft_model(tiny_ckpt, tiny_draft, watch_writes):
    llm = LLM(tiny_ckpt, block_size=4, num_kv_blocks=60, max_num_seqs=8, max_num_batched_tokens=40,
              speculative_config={"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 3})
    prompts = random_prompts(5, [30, 45, 12], vocab=300, seed=5)
    llm.generate(prompts, [SamplingParams(max_tokens=20, temperature=t, seed=2, ignore_eos=True)
                           for t in (0, 0.7, 0, 1.0, 0)])
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0
    assert "scheduler.py" in watch_writes and watch_writes <= SCHEDULER_SIDE, watch_writes - SCHEDULER_SIDE
    assert_pool_free(llm)


def test_a_write_from_elsewhere_is_seen(watch_writes):
    """The watch itself: a write, and a list change, from this file are recorded."""
    r = Request(request_id="r", prompt_token_ids=[1, 2], sampling_params=SamplingParams(), arrival_time=0.0,
                max_tokens=4)
    assert not watch_writes
    r.output_token_ids.append(3)
    assert watch_writes == {"test_one_writer.py"}
    watch_writes.clear()
    r.num_preemptions = 1
    assert watch_writes == {"test_one_writer.py"}


def test_only_the_scheduler_side_writes_requests_under_the_serving_loop(tiny_ckpt, watch_writes):
    """As a server runs it (EngineLoop: engine thread, output thread): stop strings found
    on the output thread, an abort from the caller's, n-gram speculation under async
    scheduling."""
    from backend.engine.engine_loop import EngineLoop
    llm = LLM(tiny_ckpt, block_size=4, num_kv_blocks=60, max_num_seqs=8, max_num_batched_tokens=40,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                  "prompt_lookup_min": 1})
    loop = EngineLoop(llm.engine).start()
    try:
        prompts = random_prompts(4, [30, 12], vocab=300, seed=6)
        streams = [loop.add_request(p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                      stop=["e", "a"] if i % 2 else None), f"s{i}")
                   for i, p in enumerate(prompts)]
        long = loop.add_request(prompts[0], SamplingParams(max_tokens=200, min_tokens=200, ignore_eos=True), "long")
        rest = iter(long)
        next(rest)
        loop.abort("long")
        assert list(rest)[-1].error is not None
        finals = [list(s)[-1] for s in streams]
        assert {o.finish_reason for o in finals} >= {"stop", "length"}, [o.finish_reason for o in finals]
    finally:
        loop.stop()
    assert "scheduler.py" in watch_writes and watch_writes <= SCHEDULER_SIDE, watch_writes - SCHEDULER_SIDE
    assert_pool_free(llm)
