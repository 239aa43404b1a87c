"""The async-scheduling benchmark with a draft model runs end to end (tiny sizes): both
drafts, batch 1 and the larger batch, each with async scheduling on and off in the same run
(and their outputs compared: the run fails when they differ)."""

from benchmarks.bench_spec_async import main


def test_bench_spec_async_runs_both_modes_for_both_drafts(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    results = main(["--tokens", "12", "--repeats", "1", "--batch", "3", "--hidden", "64", "--layers", "2"])
    assert {(r["batch"], r["draft"]) for r in results} == {(b, d) for b in (1, 3) for d in ("target", "random")}
    assert all(r["off_tokens_per_s"] > 0 and r["on_tokens_per_s"] > 0 for r in results)
    assert "on / off" in capsys.readouterr().out
