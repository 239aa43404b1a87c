"""Items due at a time (request deadlines, grammar compile limits), popped when due.

A heap keyed by time: a step with nothing due costs one peek, whatever the number of
requests. Entries are never removed early (a request that finishes first leaves its
entry behind); the owner skips stale ones when they come due and calls compact() when
they pile up.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Deadlines(Generic[T]):
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._seq = itertools.count()       # ties in time pop in push order; items never compare

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, when: float, item: T) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), item))

    def pop_due(self, now: float) -> list[T]:
        """Items whose time is <= now, earliest first."""
        due = []
        while self._heap and self._heap[0][0] <= now:
            due.append(heapq.heappop(self._heap)[2])
        return due

    def compact(self, keep: Callable[[T], bool]) -> None:
        """Drop the entries `keep` rejects (stale ones). O(n): call it when stale entries
        outnumber live ones, so that its cost is amortized over the pushes."""
        self._heap = [e for e in self._heap if keep(e[2])]
        heapq.heapify(self._heap)
