import os

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
