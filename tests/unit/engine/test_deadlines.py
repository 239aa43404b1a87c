"""Request deadlines (request_timeout_s): the heap (backend/engine/deadlines.py), and the
engine aborting a request past its deadline wherever it is (waiting, running, awaiting
its grammar) with a DeadlineExceededError naming request_timeout_s, its blocks free at
once, the tokens before it kept, the others served on. The engine's clock is replaced
by one the test moves, so nothing depends on how fast a step runs."""

import threading
import time

import pytest

from backend import LLM, SamplingParams
from backend.engine.deadlines import Deadlines
from backend.engine.engine_loop import EngineLoop
from backend.engine.errors import DeadlineExceededError
from backend.engine.structured_output.grammar import StructuredOutput
from tests.conftest import assert_pool_free

LONG = SamplingParams(max_tokens=40, min_tokens=40, temperature=0, ignore_eos=True)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_heap_pops_what_is_due_in_time_order_and_compacts():
    d: Deadlines[str] = Deadlines()
    for when, item in [(5.0, "c"), (1.0, "a"), (3.0, "b"), (3.0, "b2")]:
        d.push(when, item)
    assert d.pop_due(0.5) == [] and len(d) == 4
    assert d.pop_due(3.0) == ["a", "b", "b2"]
    d.push(9.0, "stale")
    d.compact(lambda item: item != "stale")
    assert len(d) == 1 and d.pop_due(100.0) == ["c"]


@pytest.fixture
def llm(llama_ckpt):
    # In series: these tests count the tokens each step() returns (with async
    # scheduling a step's tokens come out of the next one).
    llm = LLM(llama_ckpt, block_size=4, num_kv_blocks=64, max_num_seqs=1, async_scheduling=False)
    llm.engine.clock = Clock()
    yield llm
    assert_pool_free(llm)


def run(engine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_running_request_aborted_at_its_deadline_keeps_its_tokens_and_frees_its_blocks(llm):
    engine = llm.engine
    r = engine.add_request([5, 6, 7, 8, 9], LONG.model_copy(update={"request_timeout_s": 5.0}))
    streamed = []
    for _ in range(3):
        streamed += [t for out in engine.step() for t in out.new_token_ids]
    assert len(streamed) == 3 and engine.stats()["num_used_blocks"] > 0
    engine.clock.now += 4.9
    (out,) = engine.step()                                      # not yet
    assert not out.finished
    streamed += out.new_token_ids
    engine.clock.now += 0.2
    (out,) = engine.step()
    assert out.finished and out.request_id == r.request_id and out.token_ids == streamed and not out.new_token_ids
    assert isinstance(out.error, DeadlineExceededError)
    assert str(out.error) == (f"request '{r.request_id}' exceeded its deadline: request_timeout_s=5 s "
                              "(sampling parameter) after arrival; aborted after 4 generated tokens")
    assert engine.stats()["num_used_blocks"] == 0 and not engine.has_unfinished_requests()


def test_waiting_request_aborted_while_the_one_ahead_runs_on(llm):
    engine = llm.engine                                          # max_num_seqs=1: the second waits
    ahead = engine.add_request([5, 6, 7], LONG)
    waiting = engine.add_request([8, 9, 10], LONG.model_copy(update={"request_timeout_s": 1.0}))
    engine.step()
    engine.clock.now += 2
    finals = run(engine)
    assert isinstance(finals[waiting.request_id].error, DeadlineExceededError)
    assert finals[waiting.request_id].token_ids == []
    assert finals[ahead.request_id].error is None and len(finals[ahead.request_id].token_ids) == 40


def test_engine_deadline_applies_and_a_request_may_shorten_it(llama_ckpt):
    llm = LLM(llama_ckpt, block_size=4, num_kv_blocks=64, request_timeout_s=30)
    engine = llm.engine
    engine.clock = Clock()
    default = engine.add_request([5, 6, 7], LONG)
    short = engine.add_request([5, 6, 8], LONG.model_copy(update={"request_timeout_s": 10}))
    engine.step()
    engine.clock.now += 11
    (out,) = [o for o in engine.step() if o.finished]
    assert out.request_id == short.request_id and "request_timeout_s=10 s (sampling parameter)" in str(out.error)
    engine.clock.now += 20
    (out,) = [o for o in engine.step() if o.finished]
    assert out.request_id == default.request_id and "request_timeout_s=30 s (engine argument)" in str(out.error)
    assert_pool_free(llm)


def test_finished_requests_leave_no_heap_behind(llm):
    """Entries of requests that finished first are dropped when they pile up: the heap
    never holds many more than the unfinished requests (plus a constant)."""
    engine = llm.engine
    quick = SamplingParams(max_tokens=1, request_timeout_s=1e6)
    for i in range(1500):
        engine.add_request([5, 6, 7 + i % 50], quick)
        run(engine)
    assert len(engine._deadlines) <= 1024 + 1
    engine.add_request([5, 6, 7], LONG.model_copy(update={"request_timeout_s": 1.0}))
    engine.clock.now += 2                                       # the live one still expires
    (out,) = run(engine).values()
    assert isinstance(out.error, DeadlineExceededError)


def test_request_awaiting_its_grammar_aborted_at_its_deadline(tiny_ckpt, monkeypatch):
    release = threading.Event()
    compile_ = StructuredOutput._compile
    monkeypatch.setattr(StructuredOutput, "_compile",
                        lambda self, field, value: (release.wait(30), compile_(self, field, value))[1])
    llm = LLM(tiny_ckpt, num_kv_blocks=64)
    engine = llm.engine
    engine.clock = Clock()
    guided = engine.add_request("x", SamplingParams(guided_regex="[0-9]{3}", request_timeout_s=1.0))
    plain = engine.add_request("y", SamplingParams(max_tokens=8, min_tokens=8))
    engine.step()
    engine.clock.now += 1.5
    finals = run(engine)
    assert isinstance(finals[guided.request_id].error, DeadlineExceededError)
    assert finals[plain.request_id].error is None and len(finals[plain.request_id].token_ids) == 8
    release.set()
    assert_pool_free(llm)


def test_loop_stream_ends_with_the_deadline_error(llama_ckpt):
    llm = LLM(llama_ckpt, block_size=4, num_kv_blocks=64, max_num_seqs=1)
    llm.engine.clock = clock = Clock()
    clock.now = time.monotonic()    # the loop stamps arrivals with time.monotonic()
    loop = EngineLoop(llm.engine)   # not started: both requests arrive before the first step
    blocker = loop.add_request([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True), "blocker")
    late = loop.add_request([8, 9], SamplingParams(max_tokens=4, request_timeout_s=5.0), "late")
    loop.start()
    blocked = iter(blocker)
    next(blocked)                   # the blocker runs; the late one waits for its seat
    clock.now += 10
    outs = list(late)
    assert len(outs) == 1 and isinstance(outs[0].error, DeadlineExceededError)
    loop.abort("blocker")
    assert list(blocked)[-1].finished
    loop.stop()
    assert_pool_free(llm)
