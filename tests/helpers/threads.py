"""Running a test's work on a fresh thread: intra-op thread counts are per thread, and the
engine changes its caller's (backend/engine/runner/cpu_threads.py), which must not touch
the test process's."""

from __future__ import annotations

import threading


def on_fresh_thread(fn):
    """fn()'s result on a fresh thread, or what it raised, raised here. The thread is named
    as the engine's inline path expects of the offline API's thread."""
    out = {}

    def target():
        try:
            out["result"] = fn()
        except BaseException as e:      # (re-raised on the test's thread)
            out["error"] = e
    t = threading.Thread(target=target, name="MainThread")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["result"]
