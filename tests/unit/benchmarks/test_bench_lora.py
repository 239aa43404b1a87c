"""The LoRA overhead benchmark runs end to end (tiny sizes): every configuration, each
against LoRA off in the same run; its adapters load as PEFT folders; `--profile` counts
what a decode step launches."""

import math

from benchmarks.bench_lora import main


def test_bench_lora_runs_every_config(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    report = main(["--batch", "4", "--tokens", "4", "--prompt", "8", "--repeats", "1", "--hidden", "64",
                   "--layers", "2", "--heads", "4", "--vocab", "320", "--rank", "4", "--adapters", "1", "4",
                   "--profile"])
    by = {r["config"]: r for r in report["results"]}
    assert list(by) == ["base (LoRA off)", "base rows (LoRA on)", "1 adapter", "4 adapters"]
    assert by["base (LoRA off)"]["vs_baseline"] == 1.0
    # A difference of two wall times: on a busy machine one repeat at tiny sizes can even
    # come out negative. The figure must exist; its size is the benchmark's business.
    assert all(math.isfinite(r["ms_per_step"]) for r in by.values())
    assert "4 adapters" in capsys.readouterr().out
    # The profile: LoRA's shrinks and expands add operators to every step (on CPU the
    # profiler counts operators; on CUDA, kernels), and their times are a step's share.
    prof = report["profile"]
    assert list(prof) == ["base (LoRA off)", "4 adapters"]
    assert prof["4 adapters"]["kernels_per_step"] > 2 * prof["base (LoRA off)"]["kernels_per_step"] > 0
    assert all(p["top"] and p["op_ms_per_step"] > 0 for p in prof.values())
