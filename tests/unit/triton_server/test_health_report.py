import os
import shutil
import threading
import time

from backend.triton_server.health_report import (HEALTH_DIR_ENV, STOPPED, UNHEALTHY, HealthReporter,
                                                 read_reports)


def test_reporter_writes_what_the_supervisor_reads(tmp_path, monkeypatch):
    monkeypatch.delenv(HEALTH_DIR_ENV, raising=False)
    assert HealthReporter.from_env("llm_0_0", "llm", 60.0) is None  # no supervisor, no file
    monkeypatch.setenv(HEALTH_DIR_ENV, str(tmp_path))
    rep = HealthReporter.from_env("llm_0_0", "llm", 5.0)
    rep.heartbeat()
    r = read_reports(str(tmp_path))["llm_0_0"]
    assert (r.model, r.pid, r.state, r.stale_after_s) == ("llm", os.getpid(), "serving", 5.0)
    rep.unhealthy("engine_stalled", "no step for 5s")
    rep.stopped()  # an unhealthy instance keeps its cause through the unload
    r = read_reports(str(tmp_path))["llm_0_0"]
    assert (r.state, r.kind, r.cause) == (UNHEALTHY, "engine_stalled", "no step for 5s")


def test_clean_stop_and_junk_files(tmp_path):
    rep = HealthReporter(str(tmp_path), "llm_0_0", "llm", 60.0)
    rep.stopped()
    (tmp_path / "junk.json").write_text("{not json")
    (tmp_path / "other.txt").write_text("x")
    reports = read_reports(str(tmp_path))
    assert list(reports) == ["llm_0_0"] and reports["llm_0_0"].state == STOPPED
    assert read_reports(str(tmp_path / "missing")) == {}


def test_heartbeat_thread_beats_beside_other_writers(tmp_path):
    """The heartbeat has a thread of its own (a watcher blocked in a call into the server
    must not make the process look hung); it and the adapter's own writes share one
    temporary file, so they take turns: every write lands, none raises."""
    rep = HealthReporter(str(tmp_path), "llm_0_0", "llm", 60.0)
    stop, errors = threading.Event(), []

    def beat() -> None:
        try:
            rep.beat_until(stop, interval_s=0.0005)
        except Exception as e:  # noqa: BLE001 (the test reports it)
            errors.append(e)

    beater = threading.Thread(target=beat)
    beater.start()
    try:
        for _ in range(300):
            rep.heartbeat()  # another thread's writes, as unhealthy() and stopped() make
        first = read_reports(str(tmp_path))["llm_0_0"].time
        time.sleep(0.05)
        assert read_reports(str(tmp_path))["llm_0_0"].time > first  # beats without the caller
    finally:
        stop.set()
        beater.join()
    assert not errors and not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_a_failed_beat_is_said_once_and_the_beats_go_on(tmp_path, capsys):
    folder = tmp_path / "health"
    rep = HealthReporter(str(folder), "llm_0_0", "llm", 60.0)
    shutil.rmtree(folder)                                   # writes fail while it is gone
    stop = threading.Event()
    beater = threading.Thread(target=rep.beat_until, args=(stop,), kwargs={"interval_s": 0.002})
    beater.start()
    try:
        time.sleep(0.05)
        assert beater.is_alive()
        folder.mkdir()
        deadline = time.monotonic() + 5
        while "llm_0_0" not in read_reports(str(folder)):
            assert time.monotonic() < deadline, "the beats did not resume"
            time.sleep(0.005)
    finally:
        stop.set()
        beater.join()
    assert capsys.readouterr().err.count("health report not written") == 1
