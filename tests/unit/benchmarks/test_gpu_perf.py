"""Issue 50's --perf call, checked on CPU: `gpu_check --perf --dry-run` plans every stage
within 8 minutes by its own budgets and estimates, and each device call's carry within
the device tool's 64 MiB; a plan over either fails. The stages' pieces run here on the
tiny model (the FP8 copy written by the builder's writer loads and serves; throughput and
decode-against-floor report), and the report renders each target, measured or not."""

import json
import os

import pytest
import torch

from backend import LLM, SamplingParams
from benchmarks import gpu_bundle, gpu_check, gpu_perf, gpu_perf_stages, gpu_perf_table
from tests.conftest import assert_pool_free

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_dry_run_plans_within_8_minutes_and_64_mib(capsys):
    assert gpu_check.main(["--perf", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "problems: none" in out and all(f"| {s.name} |" in out for s in gpu_perf.PERF_STAGES)
    plan = gpu_perf.plan(ROOT)
    assert plan["budget_s"] <= 480 and plan["estimate_s"] <= plan["budget_s"]
    assert [c["call"] for c in plan["calls"]] == ["perf", "serve"]
    assert all(c["total_bytes"] <= 64 << 20 and c["bytes"]["working tree"] > 0 for c in plan["calls"])
    # Every planned stage is one the stage runner knows.
    assert [s.name for s in gpu_perf.PERF_STAGES] == list(gpu_perf_stages.STAGES)


def test_a_plan_over_its_limits_fails(monkeypatch):
    slow = gpu_perf.PERF_STAGES + (gpu_perf.Stage("extra", "x", "x", 100, 200, "x"),)
    assert any("budgets sum" in p for p in gpu_perf.plan(ROOT, slow)["problems"])
    assert any("estimates sum" in p for p in gpu_perf.plan(ROOT, slow)["problems"])
    monkeypatch.setattr(gpu_bundle, "call_bytes", lambda root, call, parts: {"bundle": (60 << 20) * (call == "serve")})
    problems = gpu_perf.plan(ROOT)["problems"]
    assert problems == [p for p in problems if "call 'serve' carries" in p] and problems


def test_pinned_sizes_cover_the_installed_versions():
    """A package upgraded here without its size measured again fails here, not on the device."""
    for part in gpu_bundle.SERVE_PARTS:
        assert gpu_bundle.part_bytes(part) > 0


def test_fp8_copy_serves_and_the_stage_measures(ckpt_dir, tmp_path):
    from tests.helpers.checkpoints import make_checkpoint
    src = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    dst = gpu_perf_stages.fp8_checkpoint(src, str(tmp_path / "fp8"), device="cpu")
    config = json.load(open(os.path.join(dst, "config.json")))["quantization_config"]
    assert config["quant_method"] == "paged_llm_fp8" and config["activation_scheme"] == "dynamic"
    llm = LLM(dst, block_size=4, num_kv_blocks=128, max_num_seqs=8)
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))[0].token_ids
    row = gpu_perf_stages.throughput(llm, 256, 6, 4, 5)
    assert row["output_tokens"] == 20 and row["output_tok_per_s"] > 0
    decode = gpu_perf_stages.decode_vs_floor(llm, bandwidth_gbs=10.0, tokens=4)
    assert decode["weight_read_floor_ms"] > 0 and decode["x_floor"] > 0
    assert_pool_free(llm)
    fig = gpu_perf_stages.Figures(str(tmp_path / "stage.json"))
    fig["decode"] = decode
    assert json.load(open(tmp_path / "stage.json")) == {"decode": decode}


def test_report_states_each_target(tmp_path):
    int4 = [{"config": "bfloat16", "batch": 1, "vs_baseline": 1.0}, {"config": "int4 g128", "batch": 1,
                                                                         "vs_baseline": 0.35},
            {"config": "bfloat16", "batch": 64, "vs_baseline": 1.0}, {"config": "int4 g128", "batch": 64,
                                                                          "vs_baseline": 1.2}]
    report = {"command": "c", "date": "d", "total_s": 1.0, "seconds": {"kernels": 3.0},
              "stages": {"fp8_8b": {"status": "ok", "fp8_1000_1000": {"output_tok_per_s": 18000.0},
                                    "bf16_1000_1000": {"output_tok_per_s": 9000.0},
                                    "fp8_decode_batch1": {"x_floor": 1.2}},
                         "int4_8b": {"status": "ok", "int4": int4},
                         "lora": {"status": "killed at its budget of 30 s"}}}
    text = gpu_perf_table.render(report)
    assert "| 8B FP8, 1000/1000, total output tok/s | 18,000 | >= 17,744 (TensorRT-LLM v1.0, H200) | yes |" in text
    assert "| 8B batch-1 decode, fp8, x its weight-read floor | 1.20 | <= 1.10 | NO |" in text
    assert "| INT4 (GPTQ g128) decode at batch 1, speed-up over bf16 | 2.86x | >= 2.5x | yes |" in text
    assert "| INT4 at batch 64, step time over bf16's | 1.20 | <= 1.0 | NO |" in text
    assert "not measured (lora: killed at its budget of 30 s)" in text
    assert "not measured (nano_1b: not run)" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_perf_without_a_gpu_says_so(capsys):
    assert gpu_check.main(["--perf"]) == 2
    assert "--dry-run plans it here" in capsys.readouterr().out


def test_serve_call_builds_its_entry_and_arguments(tiny_ckpt, tmp_path):
    """benchmarks/gpu_serve.py's preparation: the builder's entry for the checkpoint, and
    bench.py serve's arguments (server started on it, offline engine beside it)."""
    from benchmarks import gpu_serve
    entry = gpu_serve.build_entry(tiny_ckpt, str(tmp_path / "repo"), max_num_seqs=8)
    assert os.path.isfile(os.path.join(entry, "config.pbtxt"))
    args = gpu_serve.serve_args(str(tmp_path / "repo"), 256, gpu_serve.WORKLOAD, "x.json")
    assert args[:2] == ["serve", "--start-server"] and "--skip-offline" not in args
    assert args[args.index("--concurrency") + 1] == "256"
