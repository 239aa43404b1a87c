"""Metrics per priority class (backend/triton_server/priority_metrics.py), against a
fake of Triton's MetricFamily: each class gets its TTFT and latency histograms and its
running/waiting gauges; the classes a client can make are bounded."""

from backend.engine.scheduling.priority import counts_by_priority
from backend.triton_server.priority_metrics import MAX_CLASSES, PriorityMetrics


class Kinds:
    GAUGE, HISTOGRAM = "gauge", "histogram"


class Series:
    def __init__(self, labels):
        self.labels, self.values = labels, []

    def observe(self, v):
        self.values.append(v)

    def set(self, v):
        self.values.append(v)


class Family:
    made = []

    def __init__(self, name, desc, kind):
        self.name = name

    def Metric(self, labels, buckets=None):
        series = Series({**labels, "family": self.name})
        Family.made.append(series)
        return series


def find(**labels):
    return [s for s in Family.made if labels.items() <= s.labels.items()]


def test_each_class_has_its_latencies_and_counts():
    Family.made = []
    m = PriorityMetrics(Family, Kinds, {"model": "llm", "version": "1"}, [0.1], [1.0])
    m.observe(0, arrival=10.0, first_token_time=10.5, now=11.0)
    m.observe(5, arrival=10.0, first_token_time=12.0, now=13.0)
    m.observe(5, arrival=10.0, first_token_time=None, now=10.5)      # (ended before a token)
    assert find(family="llm_time_to_first_token_by_priority_seconds", priority="0")[0].values == [0.5]
    assert find(family="llm_time_to_first_token_by_priority_seconds", priority="5")[0].values == [2.0]
    assert find(family="llm_e2e_request_latency_by_priority_seconds", priority="5")[0].values == [3.0, 0.5]
    m.update({0: (2, 1), 5: (0, 7)})
    m.update({5: (1, 6)})                                            # class 0 gone: its gauges go to 0
    assert find(priority="0", state="running")[0].values == [2, 0]
    assert find(priority="5", state="waiting")[0].values == [7, 6]
    assert all(s.labels["model"] == "llm" for s in Family.made)


def test_client_chosen_priorities_share_one_series_past_the_bound():
    Family.made = []
    m = PriorityMetrics(Family, Kinds, {"model": "llm", "version": "1"}, [0.1], [1.0])
    for p in range(100):
        m.observe(p, 0.0, 0.1, 1.0)
    labels = {s.labels["priority"] for s in find(family="llm_time_to_first_token_by_priority_seconds")}
    assert len(labels) == MAX_CLASSES and "other" in labels
    assert len(find(family="llm_time_to_first_token_by_priority_seconds", priority="other")[0].values) == \
        100 - (MAX_CLASSES - 1)


def test_counts_by_priority():
    class R:
        def __init__(self, p):
            self.sampling_params = type("P", (), {"priority": p})()
    assert counts_by_priority([R(0), R(1), R(0)], [R(1), R(2)]) == {0: (2, 0), 1: (1, 1), 2: (0, 1)}
