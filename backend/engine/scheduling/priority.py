"""Priority scheduling (engine argument `scheduling_policy: priority`, vLLM's name): each
request's `priority` (lower runs first, as in vLLM; ties by arrival) orders the waiting
queue and the running batch.

The scheduler stays as it is for FCFS; under priority it keeps both queues in this
order, so the running request it preempts when blocks run out (the last) is always the
lowest-ranked one, never a higher-priority request for a lower one, and a waiting
request that outranks the lowest-ranked running one takes its place when the pool or
`max_num_seqs` has no room for it. There is no aging: a steady stream of
higher-priority work keeps lower priorities waiting, as in vLLM.
"""

from __future__ import annotations

import bisect
from typing import Iterable, Iterator

from backend.engine.request import Request


def rank(request: Request) -> tuple[int, float]:
    return request.sampling_params.priority, request.arrival_time


class PriorityQueue:
    """The waiting queue in (priority, arrival) order, with the deque methods the
    scheduler calls: a request put back at the front (preempted, or skipped for this
    step) goes to its place by rank; equal ranks keep their order."""

    def __init__(self) -> None:
        self._items: list[Request] = []

    def append(self, request: Request) -> None:
        """A new request: behind the requests of its rank."""
        bisect.insort_right(self._items, request, key=rank)

    def appendleft(self, request: Request) -> None:
        """Back to the queue (preempted, or skipped for a step): ahead of its rank's others."""
        bisect.insort_left(self._items, request, key=rank)

    def extendleft(self, requests: Iterable[Request]) -> None:
        """Each to the front of its rank, the last first, as deque.extendleft does."""
        for request in requests:
            self.appendleft(request)

    def popleft(self) -> Request:
        return self._items.pop(0)

    def remove(self, request: Request) -> None:
        self._items.remove(request)

    def __getitem__(self, index: int) -> Request:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)


def insert_running(running: list[Request], request: Request) -> None:
    """Into the running batch at its rank (the batch is scheduled in this order)."""
    bisect.insort_right(running, request, key=rank)


def counts_by_priority(running: list[Request], waiting: Iterable[Request]) -> dict[int, tuple[int, int]]:
    """priority -> (running, waiting): the metrics per priority class. The caller passes
    copies (the engine thread may be changing the queues)."""
    counts: dict[int, list[int]] = {}
    for k, requests in enumerate((running, waiting)):
        for r in requests:
            counts.setdefault(r.sampling_params.priority, [0, 0])[k] += 1
    return {p: (c[0], c[1]) for p, c in counts.items()}
