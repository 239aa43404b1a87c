"""The threaded loop the server uses: streams of deltas, aborts, errors, shutdown."""

import threading
import time

import pytest

from backend import LLM, EngineArgs, InvalidRequestError, QueueFullError, SamplingParams
from backend.engine.engine_loop import EngineLoop, RequestCancelled
from backend.engine.errors import EngineDeadError
from backend.engine.llm_engine import LLMEngine
from tests.conftest import assert_pool_free, random_prompts

P = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)


@pytest.fixture
def loop(llama_ckpt):
    engine = LLMEngine(EngineArgs.create(model=llama_ckpt, block_size=4, num_kv_blocks=96, max_num_seqs=4,
                                         max_num_batched_tokens=32, max_queue_size=64))
    lp = EngineLoop(engine).start()
    yield lp
    lp.stop()
    assert_pool_free(engine)


def test_streams_concatenate_to_offline_output(loop, llama_ckpt):
    prompts = random_prompts(10, [3, 40, 90, 17], seed=11)
    expected = LLM(llama_ckpt, block_size=4, num_kv_blocks=512).generate(prompts, P)
    streams = [loop.add_request(p, P, f"s{i}") for i, p in enumerate(prompts)]
    for stream, exp in zip(streams, expected):
        outs = list(stream)
        assert [t for o in outs for t in o.new_token_ids] == exp.token_ids
        assert outs[-1].finished and outs[-1].finish_reason == "length" and outs[-1].error is None
        assert sum(not o.finished for o in outs) == len(exp.token_ids) - 1


def test_abort_mid_stream_frees_blocks_and_others_finish(loop):
    prompts = random_prompts(4, [30], seed=12)
    long = SamplingParams(max_tokens=60, min_tokens=60, temperature=0)
    streams = [loop.add_request(p, long, f"a{i}") for i, p in enumerate(prompts)]
    it = iter(streams[0])
    next(it)
    loop.abort("a0")
    rest = list(it)
    assert rest[-1].finished and isinstance(rest[-1].error, RequestCancelled)
    for s in streams[1:]:
        assert list(s)[-1].finish_reason == "length"


def test_bad_request_fails_alone(loop):
    bad = loop.add_request([], P, "bad")
    good = loop.add_request([5, 6, 7], P, "good")
    out = list(bad)
    assert len(out) == 1 and isinstance(out[0].error, InvalidRequestError)
    assert list(good)[-1].finish_reason == "length"


def test_queue_limit_sheds_load(llama_ckpt):
    engine = LLMEngine(EngineArgs.create(model=llama_ckpt, block_size=4, num_kv_blocks=64, max_num_seqs=1,
                                         max_queue_size=2))
    lp = EngineLoop(engine)  # not started: fill the inbox first, then run
    streams = [lp.add_request([3, 4, 5], P, f"q{i}") for i in range(6)]
    lp.start()
    results = [list(s)[-1] for s in streams]
    shed = [r for r in results if isinstance(r.error, QueueFullError)]
    assert shed and "max_queue_size=2" in str(shed[0].error)
    assert sum(r.finish_reason == "length" for r in results) == len(results) - len(shed)
    lp.stop()
    assert_pool_free(engine)


def test_stop_grace_then_cancel(llama_ckpt):
    engine = LLMEngine(EngineArgs.create(model=llama_ckpt, block_size=4, num_kv_blocks=256))
    # At least 2 ms a step, so that the endless request cannot finish its 900 tokens
    # inside the 0.5 s this test waits, however fast the device is (a GPU does ~1 ms).
    real_step = engine.core_step

    def paced_step():
        time.sleep(0.002)
        return real_step()
    engine.core_step = paced_step
    lp = EngineLoop(engine).start()
    short = lp.add_request([3, 4], SamplingParams(max_tokens=2, temperature=0), "short")
    endless = lp.add_request([3, 4], SamplingParams(max_tokens=900, temperature=0, ignore_eos=True), "endless")
    time.sleep(0.2)
    lp.stop(grace_period_s=0.3)
    assert list(short)[-1].finish_reason == "length"
    last = list(endless)[-1]
    assert isinstance(last.error, EngineDeadError) and "shutting down" in str(last.error)
    refused = list(lp.add_request([3], P, "late"))[-1]
    assert isinstance(refused.error, EngineDeadError)
    assert_pool_free(engine)


def test_crashed_step_fails_in_flight_requests(llama_ckpt):
    engine = LLMEngine(EngineArgs.create(model=llama_ckpt, block_size=4, num_kv_blocks=64))
    calls = {"n": 0}
    real_step = engine.core_step

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device fell over")
        return real_step()

    engine.core_step = flaky_step
    lp = EngineLoop(engine).start()
    out = list(lp.add_request([3, 4, 5], SamplingParams(max_tokens=50, temperature=0), "x"))
    assert isinstance(out[-1].error, EngineDeadError) and "device fell over" in str(out[-1].error)
    assert not lp.is_alive
    assert_pool_free(engine)


def test_text_and_stop_strings_run_on_the_output_thread(tiny_ckpt, monkeypatch):
    """The engine thread never detokenizes; a stop string found on the output thread
    ends the request in the engine (blocks free: the fixture checks) with the same output
    as offline."""
    from backend.engine.output_processor import OutputProcessor
    threads = set()
    real = OutputProcessor.process

    def recording(self, core_outputs):
        threads.add(threading.current_thread().name)
        return real(self, core_outputs)
    monkeypatch.setattr(OutputProcessor, "process", recording)
    llm = LLM(tiny_ckpt, block_size=4, num_kv_blocks=256)
    prompt = "The capital of France is"
    full = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 2]
    assert stop.strip()
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop])
    threads.clear()
    expected = llm.generate(prompt, params)[0]
    assert threads == {"MainThread"} and expected.finish_reason == "stop" and len(expected.token_ids) < 20
    threads.clear()
    loop = EngineLoop(llm.engine).start()
    outs = list(loop.add_request(prompt, params, "s"))
    assert threads == {"engine-outputs"}
    assert [t for o in outs for t in o.new_token_ids] == expected.token_ids
    assert outs[-1].finish_reason == "stop" and "".join(o.new_text for o in outs) == expected.text
    deadline = time.monotonic() + 5
    while loop.engine.scheduler.num_unfinished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.engine.scheduler.num_unfinished == 0 and loop.num_in_flight == 0
    loop.stop()
    assert_pool_free(llm.engine)


def test_tokenizing_runs_on_the_callers_thread(tiny_ckpt):
    """The prompt's text and the bad words are tokenized on the thread that adds the
    request, never on the engine thread; their errors still reach the request alone, in
    the intake's order (a limit before the bad words, the bad words before the prompt)."""
    llm = LLM(tiny_ckpt, block_size=4, num_kv_blocks=256)
    tokenizer = llm.engine.tokenizer
    threads = []
    real = tokenizer.encode

    def recording(*a, **kw):
        threads.append(threading.current_thread().name)
        return real(*a, **kw)
    tokenizer.encode = recording
    loop = EngineLoop(llm.engine).start()
    try:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, bad_words=["Paris", "London"])
        expected = LLM(tiny_ckpt, block_size=4, num_kv_blocks=256).generate("The capital of France is", params)[0]
        threads.clear()
        outs = list(loop.add_request("The capital of France is", params, "s"))
        assert [t for o in outs for t in o.new_token_ids] == expected.token_ids
        assert threads and set(threads) == {threading.current_thread().name}
        tokenizer.encode = lambda *a, **kw: (_ for _ in ()).throw(ValueError("cannot tokenize"))
        out = list(loop.add_request("text", SamplingParams(max_tokens=4, bad_words=["x"]), "bad"))
        assert len(out) == 1 and isinstance(out[0].error, ValueError)
        out = list(loop.add_request("text", SamplingParams(max_tokens=4, logprobs=10_000, bad_words=["x"]), "limits"))
        assert isinstance(out[0].error, InvalidRequestError) and "logprobs" in str(out[0].error)
        out = list(loop.add_request([10 ** 9], SamplingParams(max_tokens=4, bad_words_token_ids=[[10 ** 9]]), "ids"))
        assert isinstance(out[0].error, InvalidRequestError) and "bad_words_token_ids" in str(out[0].error)
        tokenizer.encode = real
        assert list(loop.add_request([5, 6, 7], P, "good"))[-1].finish_reason == "length"
    finally:
        tokenizer.encode = real
        loop.stop()
    assert_pool_free(llm.engine)


def test_a_request_still_being_prepared_at_shutdown_gets_an_error(llama_ckpt):
    """A request whose prompt is being prepared on its caller's thread while the loop
    stops is refused with an error once prepared, never queued behind a drained inbox
    (where its stream would wait forever)."""
    import queue
    engine = LLMEngine(EngineArgs.create(model=llama_ckpt, block_size=4, num_kv_blocks=32, max_num_seqs=2))
    loop = EngineLoop(engine).start()
    entered, release = threading.Event(), threading.Event()
    real = engine.prepare

    def slow(prompt, params):
        entered.set()
        release.wait(5)
        return real(prompt, params)
    engine.prepare = slow
    got: "queue.Queue" = queue.Queue()
    adding = threading.Thread(target=lambda: loop.add_request([5, 6, 7], P, "late", callback=got.put))
    adding.start()
    assert entered.wait(5)
    loop.stop(grace_period_s=0.2)
    release.set()
    adding.join(5)
    out = got.get(timeout=2)
    assert out.finished and isinstance(out.error, EngineDeadError)
    assert loop.num_in_flight == 0
    assert_pool_free(engine)


def test_a_failing_callback_aborts_its_request_alone(loop):
    def broken(out):
        raise ConnectionError("client gone")
    loop.add_request([3, 4, 5], SamplingParams(max_tokens=200, min_tokens=200, temperature=0), "gone",
                     callback=broken)
    good = loop.add_request([5, 6, 7], P, "good")
    assert list(good)[-1].finish_reason == "length"
    deadline = time.monotonic() + 5
    while loop.engine.scheduler.num_unfinished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.engine.scheduler.num_unfinished == 0 and loop.num_in_flight == 0


def test_an_abort_that_overtakes_its_add_still_ends_the_request(loop):
    """The adapter's cancellation poll can abort a request whose add is still being
    prepared on another thread (issue 49: a closed stream ran its full length)."""
    long = SamplingParams(max_tokens=80, min_tokens=80, temperature=0)
    loop.abort("early", RequestCancelled("the client left"))
    outs = list(loop.add_request([5, 6, 7, 8], long, "early"))
    assert isinstance(outs[-1].error, RequestCancelled) and len(outs) < 80
    other = list(loop.add_request([5, 6, 7, 8], P, "later"))   # the held abort was for that id alone
    assert other[-1].finish_reason == "length" and other[-1].error is None
