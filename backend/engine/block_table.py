"""A request's block table as a list of block ids, kept by two owners: the scheduler's KV
cache manager (the one that allocates and trims) and the runner (its copy, in its
`RequestState`). The scheduler hands the runner only what changed (vLLM's new_block_ids):
`take_diff` says from which entry on the table differs from what the runner was last
sent and what it holds from there, and the runner's copy `apply_diff`s it. Entries only
change at the end (blocks appended; trailing ones given back after rejected
proposals), so a diff is a start and the entries after it.

Each entry also gets a serial number no other entry ever gets, so a reader that kept
the serials it saw (the persistent device table, runner/persistent_block_tables.py)
finds in O(changed) which leading entries are unchanged, even after entries were
trimmed and others appended in their place."""

from __future__ import annotations

import itertools
from typing import Optional

_serials = itertools.count(1)


class BlockTable(list):
    __slots__ = ("serials", "dirty_from")

    def __init__(self) -> None:
        super().__init__()
        self.serials: list[int] = []
        # The first entry that changed since the last take_diff (None: nothing did).
        self.dirty_from: Optional[int] = None

    def _changed_from(self, index: int) -> None:
        self.dirty_from = index if self.dirty_from is None else min(self.dirty_from, index)

    def append_blocks(self, block_ids: list[int]) -> None:
        if block_ids:
            self._changed_from(len(self))
        self.extend(block_ids)
        self.serials.extend(itertools.islice(_serials, len(block_ids)))

    def truncate(self, n: int) -> None:
        if n < len(self):
            del self[n:]
            del self.serials[n:]
            self._changed_from(n)

    def take_diff(self) -> tuple[int, Optional[list[int]]]:
        """(start, entries from start on): what changed since the last call; (len, None)
        when nothing did."""
        start, self.dirty_from = self.dirty_from, None
        if start is None:
            return len(self), None
        start = min(start, len(self))
        return start, self[start:]

    def apply_diff(self, start: int, block_ids: Optional[list[int]]) -> None:
        """The owner's diff applied to a copy: entries from `start` on replaced (None:
        no change). (A copy's own `dirty_from` is never read.)"""
        if block_ids is None:
            return
        if start > len(self):
            raise ValueError(f"a block-table diff from entry {start} for a table of {len(self)}")
        self.truncate(start)
        self.append_blocks(block_ids)
