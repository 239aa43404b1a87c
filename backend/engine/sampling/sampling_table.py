"""The sampler's per-row parameters, kept on the device across steps (vLLM v1's
persistent batch idea, our own code).

A request's sampling settings never change, so its row of the parameter table
(SamplingRow.params: temperature, top-k, top-p, the penalties, each logits processor's
parameter) is written to the device once, when settings not seen before first reach a
step, and every step after reads it by index: the step uploads one slot id per row, not
the rows themselves. Requests with the same settings (every greedy default request, the
n children of one request) share a slot.

A slot is taken back only when the table is full, the one written longest ago first
(choosing it costs a walk over the table, on a miss with a full table only: a hit is one
dict lookup); a slot that the current step uses is never taken, so the table grows
(doubling) if one step has more distinct settings than it holds. Writes and reads are
queued on the device in step order, so a later step rewriting a slot never changes what
an earlier step already gathered.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from backend.engine.runner.buffers import GrowingStagedBuffer


class SamplingTable:
    def __init__(self, num_columns: int, device: torch.device, capacity: int = 64, staging_slots: int = 1) -> None:
        self.device = torch.device(device)
        self.num_columns = num_columns
        self.table = torch.zeros(capacity, num_columns, dtype=torch.float32, device=self.device)
        self._slot_of: dict[tuple, int] = {}
        self._params_of: list[Optional[tuple]] = [None] * capacity
        self._written_at = [0] * capacity       # the call that wrote each slot (oldest goes first)
        self._free = list(range(capacity - 1, -1, -1))
        self._call = 0
        self._pending: list[tuple[int, tuple]] = []         # (slot, params) the last call writes
        self.written: list[int] = []                        # the slots write_pending last wrote
        self._values = GrowingStagedBuffer(torch.float32, self.device, slots=staging_slots)

    @property
    def capacity(self) -> int:
        return self.table.shape[0]

    def slots(self, rows: list[tuple]) -> list[int]:
        """The slot of each row's params (new ones are written by write_pending). A dict
        lookup per row: this runs every step over the whole batch."""
        self._call += 1
        for slot, params in self._pending:      # never written (the call before failed after slots())
            del self._slot_of[params]
            self._params_of[slot] = None
            self._free.append(slot)
        self._pending, self.written = [], []
        get = self._slot_of.get
        slots = [get(params) for params in rows]
        if None in slots:
            for i, slot in enumerate(slots):
                if slot is None:
                    slots[i] = get(rows[i])         # (a row new earlier in this call)
                    if slots[i] is None:
                        slots[i] = self._add(rows[i], slots)
        return slots

    def pending_slots(self) -> list[int]:
        """The slots the last call writes (their ids ride in the sampler's index upload);
        after write_pending, `written` holds them."""
        return [slot for slot, _ in self._pending]

    def write_pending(self, slots: Optional[torch.Tensor]) -> None:
        """The last call's new rows into the table: `slots` is pending_slots() on the
        device."""
        if not self._pending:
            return
        values = np.asarray([params for _, params in self._pending], dtype=np.float32)
        rows = self._values.upload(values.reshape(-1)).view(len(self._pending), self.num_columns)
        self.table.index_copy_(0, slots, rows)
        self.written = [slot for slot, _ in self._pending]
        self._pending = []

    def gather(self, row_slots: Optional[torch.Tensor], num_rows: int) -> torch.Tensor:
        """The step's [num_rows, num_columns] parameters (row_slots: a slot per row, on
        the device)."""
        if not num_rows:
            return self.table[:0]
        return self.table.index_select(0, row_slots)

    def _add(self, params: tuple, in_use: list[Optional[int]]) -> int:
        slot = self._take_slot(in_use)
        self._slot_of[params] = slot
        self._params_of[slot] = params
        self._written_at[slot] = self._call
        self._pending.append((slot, params))
        return slot

    def _take_slot(self, in_use: list[Optional[int]]) -> int:
        if not self._free:
            used = set(in_use)
            idle = [s for s in range(self.capacity) if s not in used]
            if idle:
                victim = min(idle, key=self._written_at.__getitem__)
                del self._slot_of[self._params_of[victim]]
                self._params_of[victim] = None
                return victim
            self._grow()
        return self._free.pop()

    def _grow(self) -> None:
        old = self.capacity
        grown = torch.zeros(2 * old, self.num_columns, dtype=torch.float32, device=self.device)
        grown[:old].copy_(self.table)
        self.table = grown
        self._params_of += [None] * old
        self._written_at += [0] * old
        self._free.extend(range(2 * old - 1, old - 1, -1))
