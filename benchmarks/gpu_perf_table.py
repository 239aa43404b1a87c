"""The --perf call's report (benchmarks/gpu_perf.py) as issue 50's table: each figure
against its target, whether it is met, then the kernel tables. A figure whose stage did
not get it says so (its stage's status)."""

from __future__ import annotations

from typing import Callable, Optional


def _get(report: dict, stage: str, key: str):
    return report.get("stages", {}).get(stage, {}).get(key)


def _rows(report: dict) -> list[tuple[str, Optional[str], str, Optional[bool], str]]:
    """(figure, measured, target, met, stage)."""
    out = []

    def add(name: str, stage: str, measure: Callable[[], tuple[str, bool]], target: str) -> None:
        try:
            measured, met = measure()
        except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError):
            measured, met = None, None
        out.append((name, measured, target, met, stage))

    for label, target in (("fp8_1000_1000", 17744), ("fp8_128_128", 27911)):
        add(f"8B FP8, {label[4:].replace('_', '/')}, total output tok/s", "fp8_8b",
            lambda label=label, target=target: (f"{_get(report, 'fp8_8b', label)['output_tok_per_s']:,.0f}",
                                                _get(report, "fp8_8b", label)["output_tok_per_s"] >= target),
            f">= {target:,} (TensorRT-LLM v1.0, H200)")
        bf16 = "bf16" + label[3:]
        add(f"8B bf16, {label[4:].replace('_', '/')} (beside it)", "fp8_8b",
            lambda bf16=bf16: (f"{_get(report, 'fp8_8b', bf16)['output_tok_per_s']:,.0f}", True), "reference")
    for fmt in ("bf16", "fp8"):
        add(f"8B batch-1 decode, {fmt}, x its weight-read floor", "fp8_8b",
            lambda fmt=fmt: (f"{_get(report, 'fp8_8b', f'{fmt}_decode_batch1')['x_floor']:.2f}",
                             _get(report, "fp8_8b", f"{fmt}_decode_batch1")["x_floor"] <= 1.10), "<= 1.10")
    add("nano-vllm workload, 1B bf16, output tok/s", "nano_1b",
        lambda: (f"{_get(report, 'nano_1b', 'nano_vllm_workload')['output_tok_per_s']:,.0f}",
                 _get(report, "nano_1b", "nano_vllm_workload")["output_tok_per_s"] >= 35000), ">= 35,000")
    add("device busy at 256 sequences", "nano_1b",
        lambda: (f"{_get(report, 'nano_1b', 'decode_profile')['device_busy']:.0%}",
                 _get(report, "nano_1b", "decode_profile")["device_busy"] >= 0.85), ">= 85%")

    def int4(batch: int) -> dict:
        rows = {r["config"].split()[0]: r for r in _get(report, "int4_8b", "int4") if r["batch"] == batch}
        return rows["int4"]
    add("INT4 (GPTQ g128) decode at batch 1, speed-up over bf16", "int4_8b",
        lambda: (f"{1 / int4(1)['vs_baseline']:.2f}x", 1 / int4(1)["vs_baseline"] >= 2.5), ">= 2.5x")
    add("INT4 at batch 64, step time over bf16's", "int4_8b",
        lambda: (f"{int4(64)['vs_baseline']:.2f}", int4(64)["vs_baseline"] <= 1.0), "<= 1.0")
    for fmt, key in (("W8A8", "w8a8"), ("FP8", "fp8")):
        def gemm(key=key) -> float:
            rows = [r for r in _get(report, "kernels", key) if int(r["shape"].split("M=")[1]) >= 256]
            return min(r["speedup"] for r in rows)
        add(f"{fmt} GEMMs at M >= 256 (8B shapes), slowest speed-up over bf16", "kernels",
            lambda gemm=gemm: (f"{gemm():.2f}x", gemm() >= 1.5), ">= 1.5x")

    def mxfp4() -> float:
        return max(r["x_floor"] for r in _get(report, "moe_mxfp4", "moe") if "mxfp4" in r["shape"] and r["batch"] <= 64)
    add("MXFP4 MoE layer (gpt-oss-20b), batch 1-64, worst x floor", "moe_mxfp4",
        lambda: (f"{mxfp4():.2f}", mxfp4() <= 2.0), "<= 2")

    def lora16() -> float:
        return next(r["vs_baseline"] for r in _get(report, "lora", "lora") if r["config"] == "16 adapters")
    add("LoRA, 16 adapters at batch 16, x the base step", "lora", lambda: (f"{lora16():.2f}", lora16() <= 1.3),
        "<= 1.3")
    return out


def render(report: dict) -> str:
    lines = [f"{report.get('command')} ({report.get('date')}, {report.get('total_s', 0):.0f} s)", "",
             "| figure | measured | target | met |", "|---|---|---|---|"]
    for name, measured, target, met, stage in _rows(report):
        if measured is None:
            status = report.get("stages", {}).get(stage, {}).get("status", "not run")
            lines.append(f"| {name} | not measured ({stage}: {status[:120]}) | {target} | |")
        else:
            lines.append(f"| {name} | {measured} | {target} | {'' if target == 'reference' else 'yes' if met else 'NO'} |")
    kernels = report.get("stages", {}).get("kernels", {})
    if any(k in kernels for k in ("w8a8", "fp8", "int4", "int8_kv")):
        from benchmarks.quant_kernel_bench import render as render_kernels
        lines += ["", render_kernels({k: kernels.get(k, []) for k in ("w8a8", "fp8", "int4", "int8_kv")})]
    moe = report.get("stages", {}).get("moe_mxfp4", {}).get("moe")
    if moe:
        from benchmarks.moe_kernel_bench import render as render_moe
        lines += ["", render_moe(moe)]
    lines += ["", "seconds per stage: " + ", ".join(f"{k} {v}" for k, v in report.get("seconds", {}).items())]
    return "\n".join(lines) + "\n"
