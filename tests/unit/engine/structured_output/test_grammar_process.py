"""backend/engine/structured_output/grammar_process.py: compiles in child processes that can be killed."""

import multiprocessing
import threading
import time

import pytest

from backend.engine.errors import InvalidRequestError
from backend.engine.structured_output.grammar_process import CompileKilled, GrammarProcess, GrammarProcesses

xgr = pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def info_json():
    return xgr.TokenizerInfo(["a", "b", "e", "f", "0", "1", "{", "}", '"', ":", ","]).serialize_json()


def test_a_compiled_grammar_comes_back_whole(info_json):
    proc = GrammarProcess(info_json)
    try:
        info = xgr.TokenizerInfo.deserialize_json(info_json)
        compiled = xgr.CompiledGrammar.deserialize_json(proc.compile("guided_regex", "[01]{2}"), info)
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string("10") and matcher.is_terminated() is False
    finally:
        proc.close()


def test_an_invalid_spec_is_the_compilers_words(info_json):
    proc = GrammarProcess(info_json)
    try:
        with pytest.raises(InvalidRequestError, match="invalid guided_regex"):
            proc.compile("guided_regex", "[0-")
        proc.compile("guided_regex", "a")           # and the process serves on
    finally:
        proc.close()


def test_kill_stops_a_compile_in_progress_at_once(info_json):
    """The point of the processes: a compile that would run for minutes ends when killed."""
    proc = GrammarProcess(info_json)
    threading.Timer(0.5, proc.kill).start()
    t0 = time.monotonic()
    with pytest.raises(CompileKilled):
        proc.compile("guided_json", {"type": "string", "pattern": "(e|f){1,16000}"})
    assert time.monotonic() - t0 < 5.0 and not proc.alive
    proc.close()


def test_each_thread_has_its_process_and_close_ends_them(info_json):
    procs = GrammarProcesses(info_json)
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(procs.current())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(p) for p in seen}) == 2 and len(procs) == 2
    seen[0].kill()
    time.sleep(0.2)
    assert len(procs) == 1
    procs.close()
    assert len(procs) == 0 and not any(p.alive for p in seen)
    with pytest.raises(CompileKilled):
        procs.current()                              # closed: no new process


def test_a_dead_process_is_closed_once_when_two_threads_close_it(info_json):
    """A killed process is closed by its own thread (discard) and by another thread's
    prune at the same moment. Both closed its pipe: the second close hit whatever file had
    taken the descriptor number meanwhile, another process's new pipe, and that compile
    failed as killed (CI run 60, a normal grammar in bench_grammar_lockout's test)."""
    proc = GrammarProcess(info_json)
    real, calls = proc._conn, []

    class SlowClose:                    # widens the window between the check and the close
        def close(self):
            calls.append(threading.get_ident())
            time.sleep(0.05)
            real.close()
    proc._conn = SlowClose()
    proc.kill()
    threads = [threading.Thread(target=proc.close) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1


def test_a_killed_process_is_left_to_its_own_thread_while_that_thread_lives(info_json):
    """Another thread's prune closed a killed process's pipe while its own thread could
    still be in recv(): the freed descriptor number went to the prune's next Pipe(), and
    the owner's read could take that new process's messages. Now the owner closes its
    own (discard), and a prune only those of threads that have ended."""
    procs = GrammarProcesses(info_json)
    owned, release = [], threading.Event()

    def owner():
        owned.append(procs.current())
        release.wait(10)

    a = threading.Thread(target=owner)
    a.start()
    while not owned:
        time.sleep(0.01)
    try:
        owned[0].kill()
        mine = procs.current()              # prunes, and starts this thread's process
        assert not owned[0]._closed         # its thread lives: left to it
        release.set()
        a.join()
        mine.kill()
        procs.current()                     # its thread has ended: closed now
        assert owned[0]._closed and mine._closed
    finally:
        release.set()
        procs.close()


def test_a_threads_process_is_ready_before_it_compiles(info_json):
    """A new process reads the tokenizer and makes its compiler first (about 0.1 s for a
    150k vocabulary): a compile thread waits for that when it starts, or after its process
    was killed, before it takes a job, so the start is not charged to the next compile's
    fast-lane time."""
    procs = GrammarProcesses(info_json)
    try:
        proc = procs.current()
        assert proc._ready                  # the child said so
        proc.kill()
        fresh = procs.current()             # a new one, ready too
        assert fresh is not proc and fresh._ready
        assert fresh.compile("guided_regex", "[01]")
    finally:
        procs.close()


def test_a_process_not_ready_is_killed_not_waited_on_for_ever(info_json):
    """A child that dies while it starts (here: tokenizer info it cannot read), or is
    not ready in time, is killed and the wait ends: no compile thread hangs on it."""
    broken = GrammarProcess("not the tokenizer's json")
    with pytest.raises(CompileKilled, match="not ready"):
        broken.wait_ready()
    broken.close()
    slow = GrammarProcess(info_json)
    # Its answers go to a pipe the wait does not read, so however fast the child starts
    # it is not ready in time (a child ready within the 0.1 ms, the parent descheduled
    # meanwhile, let the wait pass once: CI run 100).
    silent, unused = multiprocessing.Pipe()
    answers, slow._conn = slow._conn, silent
    with pytest.raises(CompileKilled, match="no answer"):
        slow.wait_ready(timeout_s=0.0001)
    assert not slow.alive
    slow.close()
    answers.close()
    unused.close()


def test_a_script_without_a_main_guard_runs_once(tmp_path):
    """multiprocessing would run the parent's main script again in each child: a user's
    script without `if __name__ == "__main__":` would run in every compile process."""
    import os
    import subprocess
    import sys
    script = tmp_path / "user_script.py"
    script.write_text(
        "import xgrammar as xgr\n"
        "from backend.engine.structured_output.grammar_process import GrammarProcess\n"
        "print('script ran', flush=True)\n"
        "proc = GrammarProcess(xgr.TokenizerInfo(['0', '1']).serialize_json())\n"
        "print(len(proc.compile('guided_regex', '[01]')) > 0, flush=True)\n"
        "proc.close()\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n").count("script ran") == 1 and "True" in out.stdout


def test_a_process_can_run_at_a_lower_cpu_priority(info_json):
    """The slow lane's processes (grammar.SLOW_LANE_NICE): the fast lane's and the engine
    get the cores first."""
    import os
    proc = GrammarProcess(info_json, nice=5)
    try:
        assert proc.compile("guided_regex", "[01]")                 # (the child has applied it by now)
        assert os.getpriority(os.PRIO_PROCESS, proc._proc.pid) == os.getpriority(os.PRIO_PROCESS, 0) + 5
    finally:
        proc.close()
