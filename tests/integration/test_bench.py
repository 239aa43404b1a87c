"""Each benchmark command runs end to end at small sizes (numbers are not asserted:
they come from benchmark runs, see docs/archive/benchmarks.md)."""

import json
import re

from benchmarks import bench, perf_analyzer


def test_offline_bench_prints_ratio_last(tiny_ckpt, capsys, tmp_path):
    bench.main(["offline", "--checkpoint", tiny_ckpt, "--num-seqs", "6", "--input-len", "8", "24",
                "--output-len", "4", "12", "--hf-batch-size", "4", "--hf-kv-blocks", "16", "--util-kv-blocks", "8", "--prefix-len", "64",
                "--static-num-seqs", "6", "--static-max-output", "16", "--static-batch", "2",
                "--json", str(tmp_path / "o.json")])
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"throughput_ratio_vs_best_peer: \d+\.\d\d", lines[-1])
    report = json.loads((tmp_path / "o.json").read_text())
    assert {"kv_utilization", "concurrency_at_fixed_kv", "prefix_caching", "inflight_vs_static"} <= set(report["figures"])
    assert len(report["throughput"]) == 3


def test_serve_bench_against_running_server(server, model_repo, tmp_path):
    out = tmp_path / "serve.json"
    bench.main(["serve", "--url", server.grpc_url, "--model-repository", model_repo, "--num-seqs", "6",
                "--input-len", "8", "32", "--output-len", "4", "12", "--concurrency", "1", "3",
                "--json", str(out)])
    report = json.loads(out.read_text())
    assert [r["summary"]["concurrency"] for r in report["runs"]] == [1, 3]
    for run in report["runs"]:
        s = run["summary"]
        assert s["completed"] == 6 and s["failed"] == 0
        assert 0 < s["fraction_of_offline"]
        assert len(run["records"]) == 6 and all(r["token_times"] for r in run["records"])


def test_perf_analyzer_streaming(server):
    # A smoke run on a 2-core CI machine busy with the server: more windows to stabilize.
    r = perf_analyzer.run(server.grpc_url, concurrency=2, seconds=2, max_tokens=8, max_trials=10)
    assert r["concurrency"] == 2 and r["infer_per_s"] > 0 and r["latency_us"] > 0


def test_openai_frontend_bench_side_by_side(server, capsys, monkeypatch):
    from benchmarks import bench_openai
    monkeypatch.setenv("TRITON_ADMIN_KEY", server.admin.key)   # its own frontend lists the models
    bench_openai.main(["frontend", "--url", server.grpc_url, "--concurrency", "2", "--tokens", "6", "--rounds", "1"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.search(r"direct gRPC \(tritonclient\) [\d.]+ ms; .* openai client [\d.]+ ms \([\d.]+x\), raw SSE", line)


def test_structured_output_bitmask_bench(tiny_ckpt, capsys):
    from benchmarks import bench_openai
    bench_openai.main(["bitmask", "--checkpoint", tiny_ckpt, "--batch", "4", "--steps", "3"])
    assert re.search(r"batch 4: decode step [\d.]+ ms; .* = [\d.]+ ms \([\d.]+% of the step\)",
                     capsys.readouterr().out)
