"""The speculative-decoding benchmark runs end to end (tiny sizes): both workloads, every
configuration, ratios against speculation off in the same run."""

from benchmarks.bench_spec import main


def test_bench_spec_runs_every_config_on_both_workloads(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    report = main(["--tokens", "24", "--repeats", "1", "--batch", "2", "--hidden", "64", "--layers", "2", "--heads", "4",
                "--vocab", "320", "--window", "8"])
    out = report["results"]
    assert report["copied_share"] > 0.5
    assert {(r["workload"], r["config"]) for r in out} == {
        (w, c) for w in ("lookup", "no-lookup")
        for c in ("off", "ngram k=4", "ngram k=8", "ngram k=4 min=1", "draft k=4")}
    by = {(r["workload"], r["config"]): r for r in out}
    assert by[("lookup", "off")]["vs_off"] == 1.0
    # The lookup workload's prompt holds the passage the model writes: proposals are accepted.
    assert by[("lookup", "ngram k=4")]["acceptance_rate"] > 0.5
    assert "lookup" in capsys.readouterr().out
