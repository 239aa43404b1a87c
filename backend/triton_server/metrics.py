"""Engine metrics on Triton's metrics endpoint, through the python backend's custom
metrics API. Names are prefixed `llm_`; each carries the label model=<name>."""

from __future__ import annotations

import gc
import time
from collections import deque

import triton_python_backend_utils as pb_utils

from backend.engine.outputs import RequestOutput

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
REJECT_REASONS = ("invalid_request", "queue_full", "engine_unavailable", "cancelled")

GAUGES = {
    "llm_num_requests_running": "Requests currently scheduled in the running batch",
    "llm_num_requests_waiting": "Requests waiting for admission",
    "llm_kv_cache_blocks_used": "KV-cache blocks referenced by requests",
    "llm_kv_cache_blocks_total": "KV-cache blocks in the pool",
    "llm_kv_cache_usage_ratio": "Fraction of KV-cache blocks in use",
}
COUNTERS = {
    "llm_prefix_cache_hit_tokens_total": "Prompt tokens served from the prefix cache",
    "llm_num_preemptions_total": "Requests preempted (recomputed) because KV blocks ran out",
    "llm_prompt_tokens_total": "Prompt tokens accepted",
    "llm_generation_tokens_total": "Tokens generated",
}
HISTOGRAMS = {
    "llm_time_to_first_token_seconds": "Time from arrival to the first generated token",
    "llm_time_per_output_token_seconds": "Mean time between generated tokens of a request, after the first",
    "llm_e2e_request_latency_seconds": "Time from arrival to the final response",
}


class EngineMetrics:
    def __init__(self, model_name: str, engine) -> None:
        self.engine = engine
        labels = {"model": model_name}
        MF = pb_utils.MetricFamily
        self._families = []  # keep families alive as long as their metrics

        def family(name, desc, kind):
            f = MF(name=name, description=desc, kind=kind)
            self._families.append(f)
            return f

        self.gauges = {n: family(n, d, MF.GAUGE).Metric(labels=labels) for n, d in GAUGES.items()}
        self.counters = {n: family(n, d, MF.COUNTER).Metric(labels=labels) for n, d in COUNTERS.items()}
        rejected = family("llm_requests_rejected_total", "Requests that ended in an error, by reason", MF.COUNTER)
        self.rejected = {r: rejected.Metric(labels={**labels, "reason": r}) for r in REJECT_REASONS}
        self.histograms = {n: family(n, d, MF.HISTOGRAM).Metric(labels=labels, buckets=LATENCY_BUCKETS)
                           for n, d in HISTOGRAMS.items()}
        self._last = {n: 0 for n in COUNTERS}
        self._finished: deque = deque()
        # Filled from other threads; deque append/popleft are thread-safe.
        self._rejected: deque = deque()
        self._gauge_values: dict[str, float] = {}

    def close(self) -> None:
        """Delete this model's series from Triton's registry, so that a model loaded again
        in the same server starts its counters from zero (Triton reuses a family and a
        labelled series that still exist). A call into the server per series: only when
        the server is not stopping."""
        self.gauges, self.counters, self.rejected, self.histograms = {}, {}, {}, {}
        self._families = []
        gc.collect()

    def _totals(self, stats: dict) -> dict[str, int]:
        return {
            "llm_prefix_cache_hit_tokens_total": stats["prefix_cache_hit_tokens"],
            "llm_num_preemptions_total": stats["num_preemptions"],
            "llm_prompt_tokens_total": self.engine.num_prompt_tokens_total,
            "llm_generation_tokens_total": self.engine.num_generation_tokens_total,
        }

    def update(self) -> None:
        """Push what changed. Called from one thread only (the adapter's watcher): metric
        calls are IPC to the server and can block while it shuts down, so they must never
        run on the engine or response threads."""
        stats = self.engine.kv_cache_stats()
        for name, total in self._totals(stats).items():
            if total > self._last[name]:
                self.counters[name].increment(total - self._last[name])
                self._last[name] = total
        while self._finished:
            self._observe(*self._finished.popleft())
        while self._rejected:
            self.rejected[self._rejected.popleft()].increment(1)
        self.update_gauges(stats)

    def update_gauges(self, s: dict) -> None:
        values = {"llm_num_requests_running": s["num_running"], "llm_num_requests_waiting": s["num_waiting"],
                  "llm_kv_cache_blocks_used": s["num_used_blocks"], "llm_kv_cache_blocks_total": s["num_total_blocks"],
                  "llm_kv_cache_usage_ratio": s["usage_ratio"]}
        for name, value in values.items():
            if self._gauge_values.get(name) != value:  # each set is a call into the server
                self.gauges[name].set(value)
                self._gauge_values[name] = value

    def on_rejected(self, reason: str) -> None:
        self._rejected.append(reason)

    def on_finished(self, out: RequestOutput, arrival: float, first_token_time) -> None:
        """Record only (any thread); update() reports it."""
        self._finished.append((out, arrival, first_token_time, time.monotonic()))

    def _observe(self, out: RequestOutput, arrival: float, first_token_time, now: float) -> None:
        if out.error is not None:
            from backend.engine.engine_loop import RequestCancelled
            from backend.engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
            reason = ("invalid_request" if isinstance(out.error, InvalidRequestError) else
                      "queue_full" if isinstance(out.error, QueueFullError) else
                      "cancelled" if isinstance(out.error, RequestCancelled) else "engine_unavailable")
            self.rejected[reason].increment(1)
            return
        self.histograms["llm_e2e_request_latency_seconds"].observe(now - arrival)
        if first_token_time is not None:
            self.histograms["llm_time_to_first_token_seconds"].observe(first_token_time - arrival)
            if out.num_output_tokens > 1:
                self.histograms["llm_time_per_output_token_seconds"].observe(
                    (now - first_token_time) / (out.num_output_tokens - 1))
