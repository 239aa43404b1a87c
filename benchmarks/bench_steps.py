"""What the decode-step benchmarks share: one decode step's wall time with the prefill
cancelled out, and the side-by-side table against a baseline row."""

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
