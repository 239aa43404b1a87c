"""Metrics per priority class, on a model whose engine schedules by priority
(`scheduling_policy: priority`): how long each class waits for its first token and for
its whole answer, and how many of each class run and wait now.

    llm_time_to_first_token_by_priority_seconds{priority}   histogram (vLLM's TTFT buckets)
    llm_e2e_request_latency_by_priority_seconds{priority}   histogram (vLLM's e2e buckets)
    llm_num_requests_by_priority{priority, state}           gauge, state "running" or "waiting"

Each series also carries the model's {model, version}. A client chooses its request's
priority, so the label's values are bounded: the first MAX_CLASSES priorities seen get
a series each, and any other shares priority="other".
"""

from __future__ import annotations

from typing import Callable

MAX_CLASSES = 16
OTHER = "other"
TTFT = "llm_time_to_first_token_by_priority_seconds"
E2E = "llm_e2e_request_latency_by_priority_seconds"
COUNTS = "llm_num_requests_by_priority"


class PriorityMetrics:
    def __init__(self, family: Callable, kinds, labels: dict[str, str], ttft_buckets: list[float],
                 e2e_buckets: list[float]) -> None:
        """family(name, description, kind) -> a MetricFamily; kinds: pb_utils.MetricFamily
        (its GAUGE and HISTOGRAM)."""
        self._labels = labels
        self._ttft = family(TTFT, "Histogram of time to first token in seconds, by request priority.",
                            kinds.HISTOGRAM)
        self._e2e = family(E2E, "Histogram of end to end request latency in seconds, by request priority.",
                           kinds.HISTOGRAM)
        self._counts = family(COUNTS, "Requests running and waiting, by request priority.", kinds.GAUGE)
        self._buckets = (ttft_buckets, e2e_buckets)
        self._classes: dict[str, tuple] = {}        # label -> (ttft, e2e, running, waiting)
        self._shown: dict[str, tuple[int, int]] = {}

    def _label(self, priority: int) -> str:
        label = str(priority)
        if label in self._classes or len(self._classes) < MAX_CLASSES - 1:
            return label
        return OTHER

    def _series(self, label: str) -> tuple:
        series = self._classes.get(label)
        if series is None:
            labels = {**self._labels, "priority": label}
            series = self._classes[label] = (
                self._ttft.Metric(labels=labels, buckets=self._buckets[0]),
                self._e2e.Metric(labels=labels, buckets=self._buckets[1]),
                self._counts.Metric(labels={**labels, "state": "running"}),
                self._counts.Metric(labels={**labels, "state": "waiting"}))
        return series

    def observe(self, priority: int, arrival: float, first_token_time, now: float) -> None:
        ttft, e2e, _, _ = self._series(self._label(priority))
        e2e.observe(now - arrival)
        if first_token_time is not None:
            ttft.observe(first_token_time - arrival)

    def update(self, counts: dict[int, tuple[int, int]]) -> None:
        """counts: priority -> (running, waiting), now (engine stats'
        `requests_by_priority`); classes seen before and absent now go to 0."""
        merged: dict[str, list[int]] = {label: [0, 0] for label in self._classes}
        for priority, (running, waiting) in counts.items():
            entry = merged.setdefault(self._label(priority), [0, 0])
            entry[0] += running
            entry[1] += waiting
        for label, (running, waiting) in merged.items():
            if self._shown.get(label) != (running, waiting):       # each set is a server call
                _, _, run_gauge, wait_gauge = self._series(label)
                run_gauge.set(running)
                wait_gauge.set(waiting)
                self._shown[label] = (running, waiting)
