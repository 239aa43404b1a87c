"""Engine metrics on Triton's metrics endpoint, under the names of Triton's vLLM backend.

vLLM-backend users' dashboards and alerts read `vllm:*` families labelled
{model, version}: the eight families of the vLLM backend's `src/utils/metrics.py`, with
its buckets and its way of observing (time per output token once per generated token
after the first; the request histograms once per finished sequence), plus the gauges
vLLM itself names (`vllm:num_requests_running`, ...). Quantities vLLM has no name for
keep ours (`llm_*`). One name per quantity.

Every metric call is IPC to the server, which can block while the server shuts down, so
nothing here runs on the engine thread: the adapter records on its response thread and
flushes right before a request's final response is sent (counts are visible by the
time a client has its answer), and its watcher pushes the gauges.
"""

from __future__ import annotations

import gc
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import triton_python_backend_utils as pb_utils

from backend.triton_server.priority_metrics import PriorityMetrics

# The vLLM backend's buckets (its metrics.py, after vLLM's sample metrics).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
N_BUCKETS = [1, 2, 5, 10, 20]
REJECT_REASONS = ("invalid_request", "queue_full", "engine_unavailable", "cancelled", "deadline_exceeded")

GAUGES = {
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "llm_kv_cache_blocks_used": "KV-cache blocks referenced by requests",
    "llm_kv_cache_blocks_total": "KV-cache blocks in the pool",
}
# Engine totals, pushed as increments.
COUNTERS = {
    "vllm:prompt_tokens_total": "Number of prefill tokens processed.",
    "vllm:generation_tokens_total": "Number of generation tokens processed.",
    "vllm:num_preemptions_total": "Cumulative number of preemption from the engine.",
    "vllm:prefix_cache_queries_total": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits_total": "Prefix cache hits, in terms of number of cached tokens.",
}
# With a speculative_config only: vLLM's spec-decode counters, under our prefix, and the
# two ratios dashboards plot (backend/engine/spec_decode/speculator.py defines them).
SPEC_COUNTERS = {
    "llm_spec_decode_num_drafts_total": "Verifications of at least one proposed token.",
    "llm_spec_decode_num_draft_tokens_total": "Proposed tokens verified by the target model.",
    "llm_spec_decode_num_accepted_tokens_total": "Proposed tokens the target model accepted.",
}
# vLLM's vllm:spec_decode_num_accepted_tokens_per_pos, labelled `position` (0: the first
# proposal of a verification).
SPEC_PER_POS = "llm_spec_decode_num_accepted_tokens_per_pos_total"
SPEC_GAUGES = {
    "llm_spec_decode_acceptance_rate": "Accepted / proposed tokens since load.",
    "llm_spec_decode_mean_acceptance_length": "Tokens per verification (accepted + 1) since load.",
}
# With kv_offloading_size only: the host KV tier (backend/engine/kv_offload/).
OFFLOAD_COUNTERS = {
    "llm_kv_offload_hit_blocks_total": "Blocks copied back from the host KV tier instead of recomputed.",
    "llm_kv_offload_saved_blocks_total": "Computed blocks copied to the host KV tier.",
}
OFFLOAD_GAUGES = {
    "llm_kv_offload_host_blocks_used": "Host KV tier slots holding a block.",
    "llm_kv_offload_host_blocks_total": "Host KV tier slots.",
}
# With LoRA: vLLM's info gauge. Its labels name the adapters of running and of waiting
# requests (comma-joined) and max_lora; its value is when they last changed. Gateway API
# inference-extension schedulers route on it (adapter affinity).
LORA_INFO = "vllm:lora_requests_info"
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "vllm:time_per_output_token_seconds": "Histogram of time per output token in seconds.",
    "vllm:e2e_request_latency_seconds": "Histogram of end to end request latency in seconds.",
    "vllm:request_prompt_tokens": "Number of prefill tokens processed.",
    "vllm:request_generation_tokens": "Number of generation tokens processed.",
    "vllm:request_params_n": "Histogram of the n request parameter.",
}


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's helper of that name)."""
    buckets, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10 ** exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


@dataclass
class SequenceTiming:
    """One finished sequence, as the response thread saw it (monotonic seconds)."""
    arrival: float
    priority: int = 0               # the request's (per-class metrics: priority_metrics.py)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    # One inter-token latency per engine output after the first token (vLLM's
    # inter_token_latencies_iter).
    inter_token_latencies: list[float] = field(default_factory=list)

    def on_tokens(self, now: float, count: int) -> None:
        if count <= 0:
            return
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.inter_token_latencies.append(now - self.last_token_time)
        self.last_token_time = now
        self.num_generation_tokens += count


def rejection_reason(error: BaseException) -> str:
    from backend.engine.engine_loop import RequestCancelled
    from backend.engine.errors import DeadlineExceededError, InvalidRequestError, QueueFullError
    return ("invalid_request" if isinstance(error, InvalidRequestError) else
            "queue_full" if isinstance(error, QueueFullError) else
            "deadline_exceeded" if isinstance(error, DeadlineExceededError) else
            "cancelled" if isinstance(error, RequestCancelled) else "engine_unavailable")


class EngineMetrics:
    def __init__(self, model_name: str, model_version: str, engine) -> None:
        self.engine = engine
        labels = {"model": model_name, "version": str(model_version)}
        MF = pb_utils.MetricFamily
        self._families = []  # keep families alive as long as their metrics

        def family(name, desc, kind):
            f = MF(name=name, description=desc, kind=kind)
            self._families.append(f)
            return f

        tokens_buckets = build_1_2_5_buckets(engine.max_model_len)
        buckets = {"vllm:time_to_first_token_seconds": TTFT_BUCKETS,
                   "vllm:time_per_output_token_seconds": TPOT_BUCKETS,
                   "vllm:e2e_request_latency_seconds": E2E_BUCKETS,
                   "vllm:request_prompt_tokens": tokens_buckets,
                   "vllm:request_generation_tokens": tokens_buckets,
                   "vllm:request_params_n": N_BUCKETS}
        speculative = getattr(engine, "speculator", None) is not None
        offload = getattr(getattr(engine, "kv_cache", None), "connector", None) is not None
        gauges = {**GAUGES, **(SPEC_GAUGES if speculative else {}), **(OFFLOAD_GAUGES if offload else {})}
        counters = {**COUNTERS, **(SPEC_COUNTERS if speculative else {}), **(OFFLOAD_COUNTERS if offload else {})}
        self.gauges = {n: family(n, d, MF.GAUGE).Metric(labels=labels) for n, d in gauges.items()}
        self.counters = {n: family(n, d, MF.COUNTER).Metric(labels=labels) for n, d in counters.items()}
        rejected = family("llm_requests_rejected_total", "Requests that ended in an error, by reason", MF.COUNTER)
        self.rejected = {r: rejected.Metric(labels={**labels, "reason": r}) for r in REJECT_REASONS}
        self.histograms = {n: family(n, d, MF.HISTOGRAM).Metric(labels=labels, buckets=buckets[n])
                           for n, d in HISTOGRAMS.items()}
        self._last = {n: 0 for n in counters}
        self.per_pos = []
        if speculative:
            per_pos = family(SPEC_PER_POS, "Accepted proposals, by their position in the verification.", MF.COUNTER)
            self.per_pos = [per_pos.Metric(labels={**labels, "position": str(i)})
                            for i in range(engine.speculator.config.num_speculative_tokens)]
            self._last.update({(SPEC_PER_POS, i): 0 for i in range(len(self.per_pos))})
        self._labels = labels
        # Under scheduling_policy priority: the same latencies and counts per priority class.
        self.priority = (PriorityMetrics(family, MF, labels, TTFT_BUCKETS, E2E_BUCKETS)
                         if getattr(getattr(engine, "args", None), "scheduling_policy", "fcfs") == "priority" else None)
        self._lora_enabled = getattr(engine, "lora", None) is not None
        self._lora_family = self._lora_series = self._lora_labels = None
        # Filled from the response and execute threads; deque append/popleft are thread-safe.
        self._pending: deque = deque()
        self._gauge_values: dict[str, float] = {}
        self._lock = threading.Lock()  # flush() runs on the response and watcher threads

    def close(self) -> None:
        """Delete this model's series from Triton's registry, so that a model loaded again
        in the same server starts its counters from zero (Triton reuses a family and a
        labelled series that still exist). A call into the server per series: only when
        the server is not stopping."""
        with self._lock:
            self.gauges, self.counters, self.rejected, self.histograms = {}, {}, {}, {}
            self.per_pos = []
            self.priority = None
            self._lora_enabled = False
            self._lora_series = self._lora_family = None
            self._families = []
        gc.collect()

    # --------------------------------------------------------------- record
    def on_rejected(self, reason: str) -> None:
        self._pending.append(("rejected", reason))

    def on_request(self, n: int) -> None:
        """A request accepted with `n` sequences (vllm:request_params_n)."""
        self._pending.append(("n", n))

    def on_sequence_finished(self, timing: SequenceTiming, error: Optional[BaseException], now: float) -> None:
        self._pending.append(("error", rejection_reason(error)) if error is not None else ("done", timing, now))

    # ---------------------------------------------------------------- flush
    def _totals(self, stats: dict) -> dict[str, int]:
        return {
            "vllm:prompt_tokens_total": self.engine.num_prompt_tokens_total,
            "vllm:generation_tokens_total": self.engine.num_generation_tokens_total,
            "vllm:num_preemptions_total": stats["num_preemptions"],
            "vllm:prefix_cache_queries_total": stats["prefix_cache_queries"],
            "vllm:prefix_cache_hits_total": stats["prefix_cache_hit_tokens"],
            **({"llm_spec_decode_num_drafts_total": stats["spec_decode_num_drafts"],
                "llm_spec_decode_num_draft_tokens_total": stats["spec_decode_num_draft_tokens"],
                "llm_spec_decode_num_accepted_tokens_total": stats["spec_decode_num_accepted_tokens"]}
               if "spec_decode_num_drafts" in stats else {}),
            **{(SPEC_PER_POS, i): n for i, n in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos", ()))},
            **({"llm_kv_offload_hit_blocks_total": stats["kv_offload_hit_blocks"],
                "llm_kv_offload_saved_blocks_total": stats["kv_offload_saved_blocks"]}
               if "kv_offload_hit_blocks" in stats else {}),
        }

    def flush(self, stats: Optional[dict] = None) -> None:
        """Push the engine's totals and every recorded observation. The engine counts a
        request's tokens before it hands out the output, so a flush before a final
        response covers that request."""
        with self._lock:
            if not self.counters:
                return
            stats = stats or self.engine.stats()
            for name, total in self._totals(stats).items():
                if total > self._last[name]:
                    counter = self.per_pos[name[1]] if isinstance(name, tuple) else self.counters[name]
                    counter.increment(total - self._last[name])
                    self._last[name] = total
            while self._pending:
                self._observe(self._pending.popleft())

    def update(self) -> None:
        """Periodic push (the watcher thread): totals, observations, gauges."""
        stats = self.engine.stats()
        self.flush(stats)
        values = {"vllm:num_requests_running": stats["num_running"],
                  "vllm:num_requests_waiting": stats["num_waiting"],
                  "vllm:kv_cache_usage_perc": stats["usage_ratio"],
                  "llm_kv_cache_blocks_used": stats["num_used_blocks"],
                  "llm_kv_cache_blocks_total": stats["num_total_blocks"],
                  "llm_spec_decode_acceptance_rate": stats.get("spec_decode_acceptance_rate"),
                  "llm_spec_decode_mean_acceptance_length": stats.get("spec_decode_mean_acceptance_length"),
                  "llm_kv_offload_host_blocks_used": stats.get("kv_offload_host_blocks_used"),
                  "llm_kv_offload_host_blocks_total": stats.get("kv_offload_host_blocks")}
        with self._lock:
            for name, value in values.items():
                if name in self.gauges and self._gauge_values.get(name) != value:  # each set is a server call
                    self.gauges[name].set(value)
                    self._gauge_values[name] = value
            if self._lora_enabled:
                self._update_lora_info(stats)
            if self.priority is not None and "requests_by_priority" in stats:
                self.priority.update(stats["requests_by_priority"])

    def _update_lora_info(self, stats: dict) -> None:
        labels = {**self._labels, "running_lora_adapters": ",".join(stats["running_lora_adapters"]),
                  "waiting_lora_adapters": ",".join(stats["waiting_lora_adapters"]),
                  "max_lora": str(stats["max_loras"])}
        if labels == self._lora_labels:
            return
        # One series at a time, as a scrape should show only the current adapters. A
        # family object holds every Metric made from it, so a series goes away only with
        # its family object: each change gets a new one (Triton shares the family by
        # name), and the old pair is dropped, Metric first.
        MF = pb_utils.MetricFamily
        family = MF(name=LORA_INFO, description="Running stats on lora requests.", kind=MF.GAUGE)
        series = family.Metric(labels=labels)
        series.set(time.time())
        self._lora_series = None
        self._lora_family = None
        self._lora_family, self._lora_series, self._lora_labels = family, series, labels

    def _observe(self, item: tuple) -> None:
        kind = item[0]
        if kind in ("rejected", "error"):
            self.rejected[item[1]].increment(1)
            return
        h = self.histograms
        if kind == "n":
            h["vllm:request_params_n"].observe(item[1])
            return
        timing, now = item[1], item[2]
        h["vllm:e2e_request_latency_seconds"].observe(now - timing.arrival)
        h["vllm:request_prompt_tokens"].observe(timing.num_prompt_tokens)
        h["vllm:request_generation_tokens"].observe(timing.num_generation_tokens)
        if timing.first_token_time is not None:
            h["vllm:time_to_first_token_seconds"].observe(timing.first_token_time - timing.arrival)
        for latency in timing.inter_token_latencies:
            h["vllm:time_per_output_token_seconds"].observe(latency)
        if self.priority is not None:
            self.priority.observe(timing.priority, timing.arrival, timing.first_token_time, now)
