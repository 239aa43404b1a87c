"""Supervisor decisions without a tritonserver: health reports and processes faked with
real files and real child processes."""

import os
import subprocess
import sys
import time

import pytest

from backend.triton_server.health_report import HealthReport, write_report
from supervisor.core import NOT_READY_AFTER_S, Supervisor, SupervisorOptions
from supervisor.status import FAILED, SERVING, Failure
from tests.helpers.children import sleeping_child as child


@pytest.fixture
def sup(tmp_path):
    s = Supervisor(SupervisorOptions(command=["true"], env={}, http_port=1, health_dir=str(tmp_path),
                                     backoff_s=0.01, kill_after_stubs_exit_s=0.3))
    s.proc = child()
    yield s
    s.proc.kill()
    s.proc.wait()


def test_options_make_no_folder_and_the_supervisor_its_own(tmp_path, monkeypatch):
    """A temporary health folder is made when a Supervisor is built, not when its options
    are (each unused SupervisorOptions left one in /tmp). Temporary folders go to the
    test's own folder here: the other CI lane's supervisors make theirs in /tmp."""
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    options = SupervisorOptions(command=[], env={}, http_port=0)
    assert options.health_dir == "" and os.listdir(tmp_path) == []
    s = Supervisor(options)
    assert os.listdir(tmp_path) == [os.path.basename(s.o.health_dir)] and options.health_dir == ""
    assert os.path.basename(s.o.health_dir).startswith("paged_llm_health_")


def report(sup, pid, state="serving", age_s=0.0, instance="llm_0_0", model="llm", **kw):
    r = HealthReport(instance=instance, model=model, pid=pid, state=state, **kw)
    write_report(sup.o.health_dir, r)
    if age_s:
        path = os.path.join(sup.o.health_dir, f"{instance}.json")
        text = open(path).read().replace(f'"time": {r.time}', f'"time": {r.time - age_s}')
        open(path, "w").write(text)


def test_nothing_wrong_is_no_failure(sup):
    stub = child("llm_0_0")
    try:
        report(sup, stub.pid)
        assert sup.check() is None
    finally:
        stub.kill()


def test_server_exit_is_a_failure(sup):
    sup.proc.kill()
    sup.proc.wait()
    assert sup.check().kind == "server_exited"


def test_a_stub_gone_before_the_server_is_the_cause(sup):
    """Triton's python backend can abort the server on a stub killed mid-call, faster than
    a poll: a stub already gone when the server is found exited is the failure's cause
    (a server that ends on its own leaves its stubs running for seconds)."""
    stub = child("llm_0_0")
    report(sup, stub.pid)
    stub.kill()
    stub.wait()
    sup.proc.kill()
    sup.proc.wait()
    f = sup.check()
    assert f.kind == "backend_died" and str(stub.pid) in f.cause and "tritonserver exited" in f.cause
    assert sup.check().kind == "server_exited"      # (the stub is handled; the server is still down)


def test_a_server_that_exits_with_its_stubs_running_is_server_exited(sup):
    stub = child("llm_0_0")
    try:
        report(sup, stub.pid)
        sup.proc.kill()
        sup.proc.wait()
        assert sup.check().kind == "server_exited"
    finally:
        stub.kill()


def test_dead_backend_is_detected_once(sup):
    stub = child("llm_0_0")
    report(sup, stub.pid)
    stub.kill()
    stub.wait()
    f = sup.check()
    assert f.kind == "backend_died" and f.model == "llm" and str(stub.pid) in f.cause
    assert sup.check() is None  # handled: one recovery per failure


def test_reused_pid_is_not_mistaken_for_the_backend(sup):
    other = child("something_else")
    try:
        report(sup, other.pid)
        assert sup.check().kind == "backend_died"
    finally:
        other.kill()


def test_a_clean_stop_is_not_a_failure(sup):
    report(sup, 999999, state="stopped")
    assert sup.check() is None


def test_unhealthy_report_names_its_cause(sup):
    stub = child("llm_0_0")
    try:
        report(sup, stub.pid, state="unhealthy", kind="engine_stalled", cause="no step for 2s")
        f = sup.check()
        assert (f.kind, f.cause) == ("engine_stalled", "no step for 2s")
    finally:
        stub.kill()


def test_stale_heartbeat_kills_the_hung_backend(sup):
    stub = child("llm_0_0")
    report(sup, stub.pid, age_s=5.0, stale_after_s=2.0)
    f = sup.check()
    assert f.kind == "backend_unresponsive"
    assert stub.wait(timeout=5) == -9


def test_recovery_retries_with_backoff_then_serves(sup, monkeypatch):
    outcomes = iter([False, False, True])
    monkeypatch.setattr(sup, "_restart_server", lambda: next(outcomes))
    sup.recover(Failure("backend_died", "killed", "llm"))
    s = sup.status.snapshot()
    assert s["state"] == SERVING and s["recoveries"] == 1 and s["recovery_attempts"] == 3
    assert s["failures"] == {"backend_died": 1} and s["last_recovery_s"] > 0


def test_failed_reload_escalates_to_a_server_restart(sup, monkeypatch):
    calls = []
    monkeypatch.setattr(sup, "_reload", lambda model: calls.append("reload") or False)
    monkeypatch.setattr(sup, "_restart_server", lambda: calls.append("restart") or True)
    sup.recover(Failure("engine_stalled", "stalled", "llm"))
    assert calls == ["reload", "restart"]


def test_recovery_gives_up_after_max_tries(sup, monkeypatch):
    monkeypatch.setattr(sup, "_restart_server", lambda: False)
    waits = []
    monkeypatch.setattr(sup._stop, "wait", lambda s: waits.append(s))
    sup.recover(Failure("backend_died", "killed", "llm"))
    s = sup.status.snapshot()
    assert s["state"] == FAILED and "gave up after 3 tries" in s["reason"] and "killed" in s["reason"]
    b = sup.o.backoff_s
    assert waits == [b, 2 * b]  # doubling backoff between tries, none before giving up
    assert sup.proc.poll() is not None  # the server is not left running half-dead


def test_shutdown_kills_a_server_that_outlives_its_models(sup):
    """Triton waiting out its exit timeout on a dead model: once no backend of ours is
    alive, the server is killed after kill_after_stubs_exit_s."""
    sup.proc.kill()
    sup.proc.wait()
    sup.proc = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
    time.sleep(0.5)  # let it install the handler
    t0 = time.monotonic()
    assert sup.shutdown() == 0
    assert time.monotonic() - t0 < 5 and sup.proc.poll() is not None


def test_stubs_tied_to_a_dead_one_hold_no_drain_up(sup):
    """A TensorRT-LLM front's requests wait on `llm`'s streams: while `llm` has a dead
    stub those never end (Triton 24.10), so the front never stops; and `llm` never
    finishes unloading the requests of a dead front. A drain or a shutdown waits only
    for stubs not tied to a dead one."""
    llm, front, other = child("llm_0_0"), child("ensemble_0_0"), child("embed_0_0")
    try:
        report(sup, llm.pid)
        report(sup, front.pid, instance="ensemble_0_0", model="ensemble", calls="llm")
        report(sup, other.pid, instance="embed_0_0", model="embed")
        assert sorted(sup._live_stubs()) == sorted([llm.pid, front.pid, other.pid])
        front.kill()
        front.wait()
        assert sup._live_stubs() == [other.pid]                   # the dead front's llm is left out
        report(sup, front.pid, instance="ensemble_0_0", model="ensemble", calls="llm", state="stopped")
        front = child("ensemble_0_0")
        report(sup, front.pid, instance="ensemble_0_0", model="ensemble", calls="llm")
        llm.kill()
        llm.wait()
        assert sup._live_stubs() == [other.pid]                   # and a dead llm's front
        report(sup, llm.pid, state="stopped")       # a clean stop ends the front's streams: it drains
        assert sorted(sup._live_stubs()) == sorted([front.pid, other.pid])
    finally:
        for p in (llm, front, other):
            p.kill()
            p.wait()


def test_a_poll_that_fails_with_emfile_does_not_end_the_supervisor(sup, monkeypatch):
    """At the descriptor limit `os.listdir` raised EMFILE out of the loop: the supervisor
    exited and left tritonserver and its stubs orphaned."""
    from clients.tritonserver import free_port
    sup.o.port, sup.o.poll_interval_s = free_port(), 0.01
    ticks = []

    def tick():
        ticks.append(1)
        if len(ticks) == 5:
            sup._stop.set()
        raise OSError(24, "Too many open files")

    monkeypatch.setattr("supervisor.core.signal.signal", lambda *a: None)   # keep pytest's handlers
    monkeypatch.setattr(sup, "_start_server", lambda: True)
    monkeypatch.setattr(sup, "tick", tick)
    monkeypatch.setattr(sup, "shutdown", lambda: 0)
    assert sup.run() == 0 and len(ticks) == 5


def test_a_late_heartbeat_makes_the_server_not_ready_before_it_is_killed(sup):
    """Issue 49 item 10: a stub hung for 20 s left /ready at 200 while requests failed.
    Late past NOT_READY_AFTER_S, /ready's reason names it; the kill waits for the stall
    timeout."""
    stub = child("llm_0_0")
    try:
        report(sup, stub.pid, stale_after_s=60.0)
        assert sup.backend_not_ready() == ""
        report(sup, stub.pid, age_s=NOT_READY_AFTER_S + 2, stale_after_s=60.0)
        assert "llm_0_0" in sup.backend_not_ready() and "no heartbeat" in sup.backend_not_ready()
        assert sup.check() is None and stub.poll() is None      # not killed yet
        report(sup, stub.pid, stale_after_s=60.0)                # it beats again
        assert sup.backend_not_ready() == ""
    finally:
        stub.kill()
