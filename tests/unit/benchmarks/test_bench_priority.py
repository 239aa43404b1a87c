"""benchmarks/bench_priority.py end to end at a small size (its figures come from
benchmark runs: docs/benchmarks.md)."""

import json

from benchmarks import bench_priority
from tests.helpers.checkpoints import make_checkpoint


def test_runs_both_policies_and_reports_each_class(ckpt_dir, tmp_path, capsys):
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    out = tmp_path / "p.json"
    bench_priority.main(["--checkpoint", path, "--num-requests", "12", "--high-fraction", "0.3", "--load", "3",
                         "--max-num-seqs", "4", "--json", str(out)])
    report = json.loads(out.read_text())
    for policy in ("fcfs", "priority"):
        for cls in ("high", "low"):
            r = report[policy][cls]
            assert r["completed"] == r["requests"] and r["ttft_p99_s"] >= r["ttft_p50_s"] > 0
    assert report["idle_ttft_s"] > 0
    assert "priority  high: TTFT" in capsys.readouterr().out
