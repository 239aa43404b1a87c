"""Benchmark metric definitions on a synthetic timestamp trace with known answers."""

import math

import pytest

from benchmarks.bench_serve import RequestRecord, percentiles, summarize


def trace():
    # Request A: sent at 0, tokens at 0.5, 0.6, 0.8 -> ttft .5, e2e .8, tpot .15, itl [.1, .2]
    a = RequestRecord(send=0.0, token_times=[0.5, 0.6, 0.8], end=0.8, num_prompt_tokens=10, num_output_tokens=3)
    # Request B: sent at 1, tokens at 1.2, 1.5 -> ttft .2, e2e .5, tpot .3, itl [.3]
    b = RequestRecord(send=1.0, token_times=[1.2, 1.5], end=1.5, num_prompt_tokens=4, num_output_tokens=2)
    failed = RequestRecord(send=0.0, token_times=[], end=0.1, num_prompt_tokens=4, num_output_tokens=0, error="x")
    return [a, b, failed]


def test_per_request_definitions():
    a, b, _ = trace()
    assert a.ttft == pytest.approx(0.5) and a.e2e == pytest.approx(0.8)
    assert a.tpot == pytest.approx(0.15)  # (e2e - ttft) / (n - 1)
    assert a.itls == pytest.approx([0.1, 0.2])
    assert b.tpot == pytest.approx(0.3)
    single = RequestRecord(send=0, token_times=[0.3], end=0.3, num_prompt_tokens=1, num_output_tokens=1)
    assert single.tpot is None


def test_summary():
    s = summarize(trace(), duration_s=2.0, slo=(400, 200))
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_token_throughput"] == pytest.approx(2.5)
    assert s["ttft_s"]["mean"] == pytest.approx(0.35)
    assert s["itl_s"]["mean"] == pytest.approx(0.2)  # pooled over requests: (.1 + .2 + .3) / 3
    assert s["tpot_s"]["p50"] == pytest.approx(0.225)
    # SLO: A fails TTFT (500 > 400 ms); B meets TTFT (200) but fails TPOT (300 > 200 ms).
    assert s["goodput"] == 0.0
    assert summarize(trace(), 2.0, slo=(600, 400))["goodput"] == pytest.approx(1.0)


def test_percentiles_interpolate_like_numpy():
    p = percentiles([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert p["p50"] == pytest.approx(5.5) and p["p90"] == pytest.approx(9.1) and p["p99"] == pytest.approx(9.91)
    assert math.isnan(percentiles([])["mean"])


def test_offline_bench_names_the_fix_for_a_missing_checkpoint(tmp_path):
    import pytest

    from benchmarks.bench import ensure_checkpoint
    with pytest.raises(SystemExit) as e:
        ensure_checkpoint(str(tmp_path / "nowhere"))
    assert "make model" in str(e.value) and "--checkpoint" in str(e.value)


def test_host_overhead_benchmark_runs_and_frees_the_pool(tiny_ckpt):
    from benchmarks.bench_host import host_ms_per_step
    assert host_ms_per_step(tiny_ckpt, num_seqs=4, prompt_len=8, steps=3) > 0


def test_the_simulated_device_run_prints_both_figures(tiny_ckpt, capsys):
    """`--device-ms D --mix` (issue 28's measurement): the mix really speculates, a step
    lasts about the simulated device's D ms (the timed window may open while the step
    before it is on the device), the pool ends free (checked inside), and both figures
    come out on their own lines."""
    from benchmarks.bench_host import main, simulated_device_run
    r = simulated_device_run(tiny_ckpt, num_seqs=6, prompt_len=24, steps=10, device_ms=5.0, mix=True)
    assert r["proposed_per_step"] > 0 and r["tokens_per_step"] > 0 and r["async_scheduling"]
    assert r["step_period_ms"] >= 4.0 and 0 < r["host_ms_per_step"]
    assert main(["--checkpoint", tiny_ckpt, "--num-seqs", "4", "--prompt-len", "16", "--steps", "3",
                 "--device-ms", "2", "--mix"]) == 0
    lines = capsys.readouterr().out.splitlines()
    figures = {line.split(":")[0]: float(line.split(":")[1]) for line in lines if not line.startswith("#")}
    assert set(figures) == {"host_ms_per_step", "step_period_ms"} and figures["step_period_ms"] > 0
