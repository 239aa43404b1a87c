"""The persistent block table's host side (vLLM's block_table.py idea): each request keeps
a row (its slot) of the device table [max_num_seqs + 1, max_blocks_per_seq] for as long as
it holds blocks, and a step sends only the block ids its requests gained since the last
step (or a whole row for a request new to the table or re-admitted). The tables it
mirrors are the runner's copies (`RequestState.block_ids`, updated from the typed step's
diffs). StepInputBuilder (step_inputs.py) applies the updates on the device."""

from __future__ import annotations

from typing import Optional

import numpy as np


class _TableRow:
    __slots__ = ("slot", "table", "serials", "length", "used")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.table: Optional[list[int]] = None  # the runner's copy it mirrors
        self.serials: list[int] = []            # BlockTable serials of the entries written
        self.length = 0                         # entries written
        self.used = 0                           # the build that last used it


class PersistentBlockTables:
    """A rank's host side of the persistent block table: which slot each request holds,
    what its row holds, and a host mirror of the rows (the slot mapping is computed from
    it). Rows are keyed by request id; a row is rewritten from the first entry that
    changed, found in O(changed) from the BlockTable serials (backend/engine/block_table.py),
    or in full for a plain list."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        self.M = max_blocks_per_seq
        self.host = np.zeros((max_num_seqs + 1, max_blocks_per_seq), dtype=np.int32)   # row 0: padding
        self.rows: dict[str, _TableRow] = {}
        self._free = list(range(max_num_seqs, 0, -1))
        self._build = 0

    def begin(self) -> None:
        self._build += 1

    def row(self, request_id: str, table: list[int], index: list[int], values: list[int]) -> int:
        """The request's slot, its row brought up to date on the host; the changed
        entries appended to (index, values) as flat table indices and block ids."""
        r = self.rows.get(request_id)
        if r is None:
            r = self.rows[request_id] = _TableRow(self._allocate())
        serials = getattr(table, "serials", None)
        n = len(table)
        if (r.table is table and serials is not None and r.length == n
                and (not n or r.serials[n - 1] == serials[n - 1])):
            r.used = self._build                # unchanged (most decode steps): nothing to send
            return r.slot
        start = 0
        if r.table is table and serials is not None:
            start = min(r.length, len(table))
            while start and r.serials[start - 1] != serials[start - 1]:
                start -= 1                      # entries trimmed and replaced since
        if n > self.M:
            raise ValueError(f"a block table of {n} blocks exceeds max_blocks_per_seq ({self.M})")
        if start < n:
            new = table[start:n]
            self.host[r.slot, start:n] = new
            base = r.slot * self.M
            index.extend(range(base + start, base + n))
            values.extend(new)
        r.table, r.length, r.used = table, n, self._build
        if serials is not None:
            del r.serials[start:]
            r.serials.extend(serials[start:n])
        return r.slot

    def _allocate(self) -> int:
        if not self._free:
            # Rows whose request no longer holds blocks (finished, preempted: the runner
            # empties its copy) first; failing that, the least recently used outside
            # this build.
            for rid, r in list(self.rows.items()):
                if not r.table and r.used < self._build:
                    self._free.append(self.rows.pop(rid).slot)
            if not self._free:
                idle = [(r.used, rid) for rid, r in self.rows.items() if r.used < self._build]
                if not idle:
                    raise ValueError("more sequences in a step than max_num_seqs")
                self._free.append(self.rows.pop(min(idle)[1]).slot)
        return self._free.pop()
