"""benchmarks/bench_grammar_lockout.py end to end at a small size (its figures come from
benchmark runs: docs/security.md)."""

import json

from benchmarks import bench_grammar_lockout


def test_both_phases_run_and_report(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "g.json"
    bench_grammar_lockout.main(["--checkpoint", tiny_ckpt, "--trials", "2", "--compile-timeout-s", "0.3",
                                "--json", str(out)])
    report = json.loads(out.read_text())
    for phase in ("two lanes", "one lane"):
        for part in ("alone", "under_attack"):
            r = report[phase][part]
            assert r["n"] == 2 and r["max_ms"] >= r["p50_ms"] > 0
    # One lane: the first grammar behind the six waited for them to reach their limit.
    assert report["one lane"]["under_attack"]["max_ms"] >= 300
    assert "behind six slow schemas" in capsys.readouterr().out
