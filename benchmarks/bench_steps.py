"""What the decode-step benchmarks share: one decode step's wall time with the prefill
cancelled out, where that step's device time goes (kernels per step, the top kernels),
and the side-by-side table against a baseline row."""

from __future__ import annotations

import json
import statistics
import time
from typing import Callable, Optional


def decode_step_ms(llm, prompts: list, params_for: Callable[[int], list], tokens: int) -> float:
    """(time for `tokens` new tokens - time for 1) / (tokens - 1), in ms: the prefill and
    the per-request overhead cancel out. params_for(n): the SamplingParams, one per prompt."""
    def run(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, params_for(n))
        return time.perf_counter() - t0
    return (run(tokens) - run(1)) / (tokens - 1) * 1e3


def decode_step_profile(llm, prompts: list, params_for: Callable[[int], list], tokens: int, top: int = 8) -> dict:
    """One decode step under torch's profiler, the prefill cancelled out as in
    decode_step_ms: (a run of `tokens` new tokens - a run of 1) / (tokens - 1). Per step:
    the kernels launched, their total time and the `top` kernels by time (device kernels
    and their time on CUDA; on CPU every operator and its self time). Tells a launch-bound step (many short kernels) from
    one bound by a slow kernel."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available() and llm.engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def kernels(n: int) -> dict[str, tuple[int, float]]:
        with profile(activities=activities) as prof:
            llm.generate(prompts, params_for(n))
            if cuda:
                torch.cuda.synchronize()
        if cuda:      # device kernels: the events that ran on the GPU
            events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            us = lambda e: e.device_time  # noqa: E731
        else:
            events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
            us = lambda e: e.self_cpu_time_total  # noqa: E731
        out: dict[str, tuple[int, float]] = {}
        for e in events:
            count, total = out.get(e.name, (0, 0.0))
            out[e.name] = (count + 1, total + us(e))
        return out

    long, short = kernels(tokens), kernels(1)
    steps = tokens - 1
    per_step = {name: ((c - short.get(name, (0, 0.0))[0]) / steps, (t - short.get(name, (0, 0.0))[1]) / steps / 1e3)
                for name, (c, t) in long.items()}
    ranked = sorted(per_step.items(), key=lambda kv: kv[1][1], reverse=True)
    return {"kernels_per_step": sum(c for c, _ in per_step.values()),
            ("device_ms_per_step" if cuda else "op_ms_per_step"): sum(ms for _, ms in per_step.values()),
            "top": [{"name": name[:80], "calls_per_step": c, "ms_per_step": ms} for name, (c, ms) in ranked[:top]]}


def report(times: dict[str, list[float]], baseline: str, extra: dict, json_path: Optional[str] = None) -> list[dict]:
    """The median of each configuration and its ratio to `baseline`, printed and returned
    (and written to json_path)."""
    base = statistics.median(times[baseline])
    width = max(len(name) for name in times)
    print(f"{'config':>{width}} {'ms/step':>8} {'vs ' + baseline:>10}")
    results = []
    for name, values in times.items():
        ms = statistics.median(values)
        results.append({"config": name, "ms_per_step": ms, "vs_baseline": ms / base, **extra})
        print(f"{name:>{width}} {ms:8.2f} {ms / base:9.2f}x")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)
    return results
