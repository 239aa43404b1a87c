"""Aborts that overtake their request's add.

`EngineLoop.add_request` prepares a prompt on its caller's thread before queueing it,
and the Triton adapter's cancellation poll runs on another thread: an abort for a request
whose client left at once can reach the engine thread before the request does. Dropped
there, it let that request run its whole length (issue 49: one of 8 streams closed
together, in 3 of 17 trials). So an abort for an id the engine does not hold is kept a
while, and applied when that id is added. Ids are unique per request; an abort for one
that had already finished only waits out its time here.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Generic, Optional, TypeVar

T = TypeVar("T")

HOLD_S = 60.0
MAX_HELD = 65536


class EarlyAborts(Generic[T]):
    """Engine-thread state (one writer): held aborts, oldest first."""

    def __init__(self, hold_s: float = HOLD_S, max_held: int = MAX_HELD) -> None:
        self._held: "OrderedDict[str, tuple[float, T]]" = OrderedDict()
        self._hold_s, self._max_held = hold_s, max_held

    def hold(self, request_id: str, abort: T) -> None:
        now = time.monotonic()
        while self._held and (len(self._held) >= self._max_held or next(iter(self._held.values()))[0] <= now):
            self._held.popitem(last=False)
        self._held[request_id] = (now + self._hold_s, abort)
        self._held.move_to_end(request_id)

    def take(self, request_id: str) -> Optional[T]:
        """The abort held for this id, if one came before it (and is not stale)."""
        held = self._held.pop(request_id, None)
        return held[1] if held is not None and held[0] > time.monotonic() else None

    def __len__(self) -> int:
        return len(self._held)
