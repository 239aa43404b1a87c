"""The grammar compile pool (backend/engine/structured_output/compile_pool.py): a job given up on keeps its
thread, and a replacement serves the jobs queued behind it; a job not yet started is
simply cancelled. Jobs here block on events: nothing depends on timing."""

import threading

from backend.engine.structured_output.compile_pool import CompilePool


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
