"""Asynchronous sends (torch.distributed `isend`, `async_op=True` collectives) still under
way. Gloo's send waits until the receiver has posted its receive, so a rank that must
not stop for a busy peer (rank 0 with micro-batches in flight, a stage handing its
hidden state on) issues them asynchronously and keeps each tensor alive here until its
send is done."""

from __future__ import annotations

from collections import deque

import torch


class PendingWorks:
    """Works in issue order, each with the tensor it sends."""

    def __init__(self) -> None:
        self._works: deque = deque()

    def add(self, work, tensor: torch.Tensor) -> None:
        self.prune()
        self._works.append((work, tensor))

    def prune(self) -> None:
        """Drop the completed works at the front (waited on: a failed one raises here)."""
        while self._works and self._works[0][0].is_completed():
            self._works.popleft()[0].wait()

    def wait_all(self) -> None:
        while self._works:
            self._works.popleft()[0].wait()

    def __len__(self) -> int:
        return len(self._works)
