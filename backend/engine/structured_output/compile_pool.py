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

Two lanes (with `fast_s`): every job starts in the fast lane; one still running after
`fast_s` is interrupted there and starts again in the slow lane (its own `slow_size`
threads), where it runs to its end or its time limit (whose clock starts again there:
`started` gets the job a second time). So a job never waits in the fast
lane behind another for more than about `fast_s`, however many slow jobs arrive: a few
tiny schemas that compile for minutes (issue 49 item 9) cost the fast lane `fast_s` each
and then only hold up each other. A job that cannot be interrupted stays where it is.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import CancelledError, Future
from typing import Any, Callable, Optional


class Job:
    """One submitted call: its future, when a worker started it, and the caller's tag."""
    __slots__ = ("fn", "args", "tag", "future", "started", "abandoned", "interrupt", "running", "replaced",
                 "slow", "demoting")

    def __init__(self, fn: Callable[..., Any], args: tuple, tag: Any) -> None:
        self.fn, self.args, self.tag = fn, args, tag
        self.future: Future = Future()
        self.started: Optional[float] = None    # time.monotonic() when a worker first took it
        self.abandoned = False
        self.interrupt: Optional[Callable[[], None]] = None   # set by fn: stops it from another thread
        self.running = False                    # a worker runs it now
        self.replaced = False                   # given up on while running: its worker was replaced
        self.slow = False                       # moved to the slow lane
        self.demoting = False                   # interrupted to move it there


_running = threading.local()


def current_job() -> Optional[Job]:
    """The job the calling worker thread runs (None outside a pool's worker)."""
    return getattr(_running, "job", None)


def in_slow_lane() -> bool:
    """Whether the calling thread is one of a pool's slow-lane workers."""
    return getattr(_running, "slow", False)


class CompilePool:
    def __init__(self, size: int = 1, name: str = "grammar",
                 initializer: Optional[Callable[[], Any]] = None, fast_s: Optional[float] = None,
                 slow_size: int = 1) -> None:
        """`initializer`: run by each worker thread before it takes a job (the grammar
        compiles start their process there: a job's time limit, which starts when a worker
        takes it, is not charged for that). `fast_s`: the fast lane's limit per job (None:
        one lane)."""
        self._jobs: "queue.SimpleQueue[Optional[Job]]" = queue.SimpleQueue()
        self._slow_jobs: "queue.SimpleQueue[Optional[Job]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._name = name
        self._initializer = initializer
        self._abandoned = 0
        self._threads = 0
        self.fast_s = fast_s
        self._fast_running: dict[Job, float] = {}      # fast-lane jobs running, by start time
        self._closed = False
        # Jobs as workers first start them: the caller's clock for per-job time limits
        # starts there, not at submit (a job queued behind a slow one is not charged for it).
        self.started: "queue.SimpleQueue[Job]" = queue.SimpleQueue()
        for _ in range(size):
            self._spawn(slow=False)
        if fast_s is not None:
            for _ in range(slow_size):
                self._spawn(slow=True)
            threading.Thread(target=self._watch, name=f"{name}-watch", daemon=True).start()

    @property
    def num_abandoned(self) -> int:
        """Jobs given up on whose thread is still running them."""
        return self._abandoned

    def submit(self, fn: Callable[..., Any], *args: Any, tag: Any = None) -> Job:
        job = Job(fn, args, tag)
        self._jobs.put(job)
        return job

    def abandon(self, job: Job) -> None:
        """Give up on a job: cancelled if no worker took it yet (or dropped from the slow
        lane's queue); if one is running it, a replacement worker starts and the old one
        exits once the call returns."""
        with self._lock:
            if job.future.cancel() or job.future.done() or job.abandoned:
                return
            job.abandoned = True
            if not job.running:                 # between lanes or queued in the slow one
                return
            job.replaced = True
            self._abandoned += 1
        if job.interrupt is not None:
            job.interrupt()
        self._spawn(slow=job.slow)

    def _spawn(self, slow: bool) -> None:
        with self._lock:
            self._threads += 1
            n = self._threads
        threading.Thread(target=self._work, args=(slow,), name=f"{self._name}-{'slow-' if slow else ''}{n}",
                         daemon=True).start()

    def _work(self, slow: bool) -> None:
        _running.slow = slow
        if self._initializer is not None:
            try:
                self._initializer()
            except Exception:                   # the job's own call meets it again, and says so
                pass
        jobs = self._slow_jobs if slow else self._jobs
        while True:
            job = jobs.get()
            if job is None:
                jobs.put(None)                  # shutdown(): wake the next worker too
                return
            if not job.slow and not job.future.set_running_or_notify_cancel():
                continue                        # abandoned before it started
            with self._lock:
                if job.abandoned:               # given up on between lanes, or queued in the slow one
                    dropped = True
                else:
                    dropped, job.running = False, True
                    if not slow and self.fast_s is not None:
                        self._fast_running[job] = time.monotonic()
                        self._wake.notify()
            if dropped:
                job.future.set_exception(CancelledError())
                continue
            if job.started is None or slow:     # (a moved job's time limit starts again in the slow lane)
                job.started = time.monotonic()
                self.started.put(job)
            _running.job = job
            result, error = None, None
            try:
                result = job.fn(*job.args)
            except BaseException as e:          # the caller reads it from the future
                error = e
            finally:
                _running.job = None
            with self._lock:
                job.running = False
                self._fast_running.pop(job, None)       # (_watch interrupts only jobs in here)
                job.interrupt = None
                moved = error is not None and job.demoting and not job.abandoned and not self._closed
                if moved:                       # interrupted by _watch: to the slow lane
                    job.slow, job.demoting = True, False
                    self._slow_jobs.put(job)
            if not moved:
                if error is None:
                    job.future.set_result(result)
                elif job.demoting and not job.abandoned:
                    job.future.set_exception(CancelledError())      # (shutting down)
                else:
                    job.future.set_exception(error)
            if job.replaced:                    # a replacement took this thread's place
                with self._lock:
                    self._abandoned -= 1
                return
            if self._initializer is not None:
                try:                            # its process killed (by the watch, maybe just after
                    self._initializer()         # the compile returned): the next one starts now, not
                except Exception:               # within the next job's time in the fast lane
                    pass

    def _watch(self) -> None:
        """Interrupts fast-lane jobs past fast_s (each then moves to the slow lane)."""
        fast_s = self.fast_s
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                due = [job for job, start in self._fast_running.items()
                       if now - start >= fast_s and not job.demoting and job.interrupt is not None]
                for job in due:
                    # Under the lock: the job is still running its fast-lane call, so this
                    # interrupt is that call's (a kill: milliseconds at most).
                    job.demoting = True
                    job.interrupt()
                if due:
                    continue
                # A job past fast_s whose function has not said how to stop it (yet, or at
                # all: compiles on threads) is looked at again after another fast_s.
                waiting = [start + fast_s - now if start + fast_s > now else fast_s
                           for job, start in self._fast_running.items() if not job.demoting]
                self._wake.wait(min(waiting) if waiting else None)

    def shutdown(self) -> None:
        """Idle workers exit; running (or abandoned) ones after their call."""
        with self._lock:
            self._closed = True
            self._wake.notify()
        self._jobs.put(None)
        self._slow_jobs.put(None)
