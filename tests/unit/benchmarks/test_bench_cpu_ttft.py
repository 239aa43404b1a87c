"""benchmarks/bench_cpu_ttft.py end to end at a small size (its figures come from
benchmark runs: docs/archive/benchmarks.md)."""

import json

from benchmarks import bench_cpu_ttft
from tests.helpers.checkpoints import make_checkpoint


def test_runs_both_modes_alone_and_busy(ckpt_dir, tmp_path, capsys):
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    out = tmp_path / "t.json"
    bench_cpu_ttft.main(["--checkpoint", path, "--num-prompts", "3", "--busy", "2", "--json", str(out)])
    report = json.loads(out.read_text())
    assert set(report) == {"alone_in_series", "alone_ahead", "busy_in_series", "busy_ahead"}
    assert all(r["p99_s"] >= r["p50_s"] > 0 for r in report.values())
    assert "busy  TTFT p50 / p99: in series" in capsys.readouterr().out

