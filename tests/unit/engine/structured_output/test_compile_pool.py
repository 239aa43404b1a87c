"""The grammar compile pool (backend/engine/structured_output/compile_pool.py): a job given up on keeps its
thread, and a replacement serves the jobs queued behind it; a job not yet started is
simply cancelled; with two lanes, a job past the fast lane's limit is interrupted and goes
on in the slow lane. Jobs here block on events; the two-lane tests' margins are seconds
against the lanes' tens of milliseconds."""

import threading
import time
from concurrent.futures import CancelledError

import pytest

from backend.engine.structured_output.compile_pool import CompilePool, current_job


def test_abandoned_job_is_replaced_and_the_queue_behind_it_runs():
    pool = CompilePool(1, "test")
    stuck, release = threading.Event(), threading.Event()

    def slow():
        stuck.set()
        release.wait(30)
        return "late"

    first = pool.submit(slow, tag="first")
    second = pool.submit(lambda x: x * 2, 21, tag="second")
    assert stuck.wait(10) and pool.started.get(timeout=10) is first and first.started is not None
    assert not second.future.done()             # one worker, busy with the first
    pool.abandon(first)
    assert pool.num_abandoned == 1
    assert second.future.result(timeout=10) == 42        # served by the replacement
    assert pool.started.get(timeout=10) is second
    release.set()
    assert first.future.result(timeout=10) == "late"     # it ends on its own...
    for _ in range(1000):                                # ...and its thread with it
        if pool.num_abandoned == 0:
            break
        threading.Event().wait(0.01)
    assert pool.num_abandoned == 0
    pool.abandon(first)                                  # done: nothing to give up
    assert pool.num_abandoned == 0
    pool.shutdown()


def test_a_job_not_started_is_cancelled_and_never_runs():
    pool = CompilePool(1, "test")
    gate = threading.Event()
    running = pool.submit(gate.wait, 30)
    ran = []
    queued = pool.submit(lambda: ran.append(1))
    pool.abandon(queued)
    assert queued.future.cancelled() and pool.num_abandoned == 0
    gate.set()
    assert running.future.result(timeout=10) is True
    after = pool.submit(lambda: "next")
    assert after.future.result(timeout=10) == "next" and ran == []
    pool.shutdown()


def test_a_failing_job_gives_its_exception():
    pool = CompilePool(1, "test")
    job = pool.submit(lambda: 1 / 0)
    assert isinstance(job.future.exception(timeout=10), ZeroDivisionError)
    pool.shutdown()


def interruptible(slow_lane_s: float):
    """A job that runs until interrupted in the fast lane, and for slow_lane_s in the slow
    lane; it returns how many times it was started."""
    starts = []

    def run():
        job = current_job()
        starts.append(job.slow)
        if job.slow:
            time.sleep(slow_lane_s)
            return len(starts)
        stop = threading.Event()
        job.interrupt = stop.set
        if stop.wait(30):
            raise RuntimeError("interrupted")
        return len(starts)
    return run


def test_a_job_past_fast_s_goes_on_in_the_slow_lane_and_the_fast_lane_stays_free():
    """Three jobs that would hold the one fast worker for 30 s each: each is interrupted
    at fast_s and finishes in the slow lane (0.5 s each, one at a time), while a quick job
    submitted behind them is done long before the slow lane is."""
    pool = CompilePool(1, "test", fast_s=0.05, slow_size=1)
    done_at = {}
    slow = [pool.submit(interruptible(0.5), tag=i) for i in range(3)]
    quick = pool.submit(lambda: "quick", tag="quick")
    for job in slow + [quick]:
        job.future.add_done_callback(lambda _, tag=job.tag: done_at.setdefault(tag, time.monotonic()))
    assert quick.future.result(timeout=10) == "quick"
    assert [job.future.result(timeout=10) for job in slow] == [2, 2, 2]      # started twice each
    assert done_at["quick"] < min(done_at[i] for i in range(3))
    started = []
    while not pool.started.empty():
        started.append(pool.started.get())
    # At each start: the moved ones again in the slow lane (their time limit starts again).
    assert [started.count(job) for job in slow + [quick]] == [2, 2, 2, 1] and list(dict.fromkeys(started)) == slow + [quick]
    assert pool.num_abandoned == 0
    pool.shutdown()


def test_a_job_that_cannot_be_interrupted_stays_in_the_fast_lane():
    pool = CompilePool(1, "test", fast_s=0.01, slow_size=1)
    job = pool.submit(lambda: (time.sleep(0.2), current_job().slow)[1])
    assert job.future.result(timeout=10) is False
    pool.shutdown()


def test_a_job_given_up_on_in_the_slow_lanes_queue_is_dropped():
    pool = CompilePool(1, "test", fast_s=0.02, slow_size=1)
    first = pool.submit(interruptible(1.0))
    second = pool.submit(interruptible(1.0))
    for _ in range(1000):                       # both moved: the first runs in the slow lane, the second waits
        if first.running and first.slow and second.slow and not second.running:
            break
        time.sleep(0.01)
    pool.abandon(second)
    assert pool.num_abandoned == 0              # it held no thread
    with pytest.raises(CancelledError):
        second.future.result(timeout=10)
    assert first.future.result(timeout=10) == 2
    pool.shutdown()
