"""Worker threads for grammar compilation, whose stuck jobs can be given up on.

xgrammar compiles in C++ with the GIL released (measured: a Python thread spinning
beside a 2 s compile keeps its full rate), so a worker thread never stalls the engine
thread. What a thread cannot do is stop a compile: a job given up on (past
guided_compile_timeout_s, or its request aborted) keeps its thread until xgrammar
returns. abandon() then starts a replacement thread, so the jobs queued behind never wait
for it; the abandoned thread ends when its compile does. `num_abandoned` lets the caller
refuse new work while too many such threads still run (each holds a CPU core).

A job can say how to stop it: its function sets `current_job().interrupt` (the grammar
compiles kill their process: grammar_process.py), which abandon() calls, so the thread
is back within milliseconds instead of when the work would have ended.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional


class Job:
    """One submitted call: its future, when a worker started it, and the caller's tag."""
    __slots__ = ("fn", "args", "tag", "future", "started", "abandoned", "interrupt")

    def __init__(self, fn: Callable[..., Any], args: tuple, tag: Any) -> None:
        self.fn, self.args, self.tag = fn, args, tag
        self.future: Future = Future()
        self.started: Optional[float] = None    # time.monotonic() when a worker took it
        self.abandoned = False
        self.interrupt: Optional[Callable[[], None]] = None   # set by fn: stops it from another thread


_running = threading.local()


def current_job() -> Optional[Job]:
    """The job the calling worker thread runs (None outside a pool's worker)."""
    return getattr(_running, "job", None)


class CompilePool:
    def __init__(self, size: int = 1, name: str = "grammar",
                 initializer: Optional[Callable[[], Any]] = None) -> None:
        """`initializer`: run by each worker thread before it takes a job (the grammar
        compiles start their process there: a job's time limit, which starts when a worker
        takes it, is not charged for that)."""
        self._jobs: "queue.SimpleQueue[Optional[Job]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._name = name
        self._initializer = initializer
        self._abandoned = 0
        self._threads = 0
        # Jobs as workers start them: the caller's clock for per-job time limits starts
        # there, not at submit (a job queued behind a slow one is not charged for it).
        self.started: "queue.SimpleQueue[Job]" = queue.SimpleQueue()
        for _ in range(size):
            self._spawn()

    @property
    def num_abandoned(self) -> int:
        """Jobs given up on whose thread is still running them."""
        return self._abandoned

    def submit(self, fn: Callable[..., Any], *args: Any, tag: Any = None) -> Job:
        job = Job(fn, args, tag)
        self._jobs.put(job)
        return job

    def abandon(self, job: Job) -> None:
        """Give up on a job: cancelled if no worker took it yet; if one is running it, a
        replacement worker starts and the old one exits once the call returns."""
        with self._lock:
            if job.future.cancel() or job.future.done() or job.abandoned:
                return
            job.abandoned = True
            self._abandoned += 1
        if job.interrupt is not None:
            job.interrupt()
        self._spawn()

    def _spawn(self) -> None:
        with self._lock:
            self._threads += 1
            n = self._threads
        threading.Thread(target=self._work, name=f"{self._name}-{n}", daemon=True).start()

    def _work(self) -> None:
        if self._initializer is not None:
            try:
                self._initializer()
            except Exception:                   # the job's own call meets it again, and says so
                pass
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.put(None)            # shutdown(): wake the next worker too
                return
            if not job.future.set_running_or_notify_cancel():
                continue                        # abandoned before it started
            job.started = time.monotonic()
            self.started.put(job)
            _running.job = job
            try:
                job.future.set_result(job.fn(*job.args))
            except BaseException as e:          # the caller reads it from the future
                job.future.set_exception(e)
            finally:
                _running.job = None
            with self._lock:
                if job.abandoned:               # a replacement took this thread's place
                    self._abandoned -= 1
                    return

    def shutdown(self) -> None:
        """Idle workers exit; running (or abandoned) ones after their call."""
        self._jobs.put(None)
