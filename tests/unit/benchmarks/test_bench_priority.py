"""benchmarks/bench_priority.py end to end at a small size (its figures come from
benchmark runs: docs/archive/benchmarks.md)."""

import json

from benchmarks import bench_priority
from tests.helpers.checkpoints import make_checkpoint


def test_runs_both_policies_and_reports_each_class(ckpt_dir, tmp_path, capsys):
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    out = tmp_path / "p.json"
    bench_priority.main(["--checkpoint", path, "--num-requests", "12", "--high-fraction", "0.3", "--load", "3",
                         "--max-num-seqs", "4", "--num-kv-blocks", "256", "--json", str(out)])
    report = json.loads(out.read_text())
    for policy in ("fcfs", "priority", "priority+cap"):
        for cls in ("high", "low"):
            r = report[policy][cls]
            assert r["completed"] == r["requests"] and r["ttft_p99_s"] >= r["ttft_p50_s"] > 0
    assert report["idle_ttft_p99_s"] >= report["idle_ttft_p50_s"] > 0
    printed = capsys.readouterr().out
    assert "priority     high: TTFT" in printed and "priority+cap high: TTFT" in printed


def test_idle_ttft_is_the_first_tokens_not_the_last(ckpt_dir):
    """(RequestOutput.token_ids is filled in on the final output only: timing it gave the
    whole request's latency, which §21's first figures were.)"""
    import time

    from backend import LLM
    llm = LLM(make_checkpoint(str(ckpt_dir / "llama"), "llama"), block_size=16, num_kv_blocks=64)
    request = (list(range(3, 40)), 64, True)
    first = bench_priority.idle_ttfts(llm, [request])
    assert len(first) == 1 and not llm.engine.has_unfinished_requests()
    start = time.perf_counter()
    llm.generate([request[0]], [bench_priority.params(request[1], 0)])
    assert first[0] < (time.perf_counter() - start) / 4        # the whole request: 64 tokens
