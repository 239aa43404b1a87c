"""Per-request token state for the sampler's penalties, kept across steps on the
sampler's device, so that preparing a step never walks a request's whole prompt or
output (vLLM v1's persistent-batch idea: token counts per row; our own code).

Each request that uses a penalty holds a slot: a row of
- `seen`   bool    [slots, V]: its prompt and output tokens (repetition_penalty), and
- `counts` float32 [slots, V]: how often it generated each token (frequency_penalty,
  presence_penalty); exact integers up to 2**24.

A slot is filled from the request's whole prompt and output the first time a step samples
for it (once per request, at the end of its prefill) and afterwards only with the tokens
its output gained since the last step: O(new tokens) per step. The updates ride in the
sampler's one host-to-device copy; on the device they are an index_fill and two
index_puts, so no step reads anything back.

The state follows the request, not the step:
- Preemption keeps the output (recompute redoes only K/V), so the slot stays right and a
  resumed request carries on from it.
- Proposed tokens under verification never enter the state: a verification row adds
  its proposals for that row only (see Sampler.prepare), so rejected ones leave no trace.
- A request whose output shrank, or whose prompt or output list was replaced, is
  refilled from scratch: what a full recompute would give. (The engine only ever appends
  to an output and never changes a prompt in place; a shrink followed by regrowth past
  the old length between two steps would be seen only through the last token.)
- n > 1 children are requests of their own, each with its own slot.

Slots of finished (or garbage-collected) requests are taken back when a slot is needed
and none is free; failing that the tables grow (doubling) up to max_slots
(max_num_seqs), past which the least recently sampled request not in this step gives its
slot up (refilled if it comes back); only a step with more penalized requests than slots
grows them further. Slot 0 is all zeros: the slot of rows that use no penalty. The tables
exist only once some request uses them.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch


class _Entry:
    __slots__ = ("ref", "slot", "prompt", "output", "counted", "last", "seen", "counts", "used")

    def __init__(self, request, slot: int, seen: bool, counts: bool) -> None:
        self.ref = weakref.ref(request)
        self.slot = slot
        self.prompt = request.prompt_token_ids
        self.output = request.output_token_ids
        self.counted = 0            # output tokens in the slot
        self.last: Optional[int] = None   # the last of them
        self.seen, self.counts = seen, counts
        self.used = 0               # the prepare call that last used it


class PenaltyState:
    def __init__(self, device: torch.device, initial_slots: int = 8, max_slots: int = 256) -> None:
        self.device = torch.device(device)
        self.initial_slots = initial_slots
        # Beyond this many slots, a request not in the step gives its slot up before the
        # tables grow.
        self.max_slots = max_slots
        self._true = torch.ones((), dtype=torch.bool, device=self.device)
        self._one = torch.ones((), dtype=torch.float32, device=self.device)
        self.reset()

    def reset(self, vocab_size: int = 0) -> None:
        """Forget every request (each is refilled from scratch when next sampled)."""
        self.vocab_size = vocab_size
        self.capacity = 0           # rows in the tables, slot 0 included
        self.seen: Optional[torch.Tensor] = None
        self.counts: Optional[torch.Tensor] = None
        self._entries: dict[int, _Entry] = {}
        self._free: list[int] = []
        self._call = 0
        # This call's updates: slots to clear, (slot, token ids) to mark seen and to count.
        self._clear: list[int] = []
        self._seen_updates: list[tuple[int, list[int]]] = []
        self._count_updates: list[tuple[int, list[int]]] = []

    # ------------------------------------------------------------------ host side
    def begin(self, vocab_size: int) -> None:
        """Start a prepare call."""
        if vocab_size != self.vocab_size:
            self.reset(vocab_size)
        self._call += 1
        self._clear, self._seen_updates, self._count_updates = [], [], []

    def slot(self, request, seen: bool, counts: bool) -> int:
        """The request's slot, brought up to date with its output (updates queued)."""
        self._ensure_tables(seen, counts)
        e = self._entries.get(id(request))
        if e is not None and e.used == self._call and e.ref() is request:
            return e.slot                       # a second row of the same request
        out = request.output_token_ids
        if (e is not None and e.ref() is request and e.prompt is request.prompt_token_ids and e.output is out
                and e.counted <= len(out) and (e.counted == 0 or out[e.counted - 1] == e.last)
                and (e.seen or not seen) and (e.counts or not counts)):
            new = out[e.counted:]
            if new:
                if e.seen:
                    self._seen_updates.append((e.slot, new))
                if e.counts:
                    self._count_updates.append((e.slot, new))
        else:
            if e is not None and e.ref() is request:
                slot = e.slot                   # refilled in place
            else:
                if e is not None:               # another object at a recycled address
                    self._release(id(request))
                slot = self._allocate()
            e = self._entries[id(request)] = _Entry(request, slot, seen, counts)
            self._clear.append(slot)
            if seen:
                self._seen_updates.append((slot, request.prompt_token_ids))
                if out:
                    self._seen_updates.append((slot, out))
            if counts and out:
                self._count_updates.append((slot, out))
        e.counted = len(out)
        e.last = out[-1] if out else None
        e.used = self._call
        return e.slot

    def host_updates(self) -> list[list[int]]:
        """This call's updates as flat lists, for the sampler's one upload: slots to
        clear, then (slots, token ids) to mark seen, then (slots, token ids) to count."""
        out: list[list[int]] = [self._clear]
        for updates in (self._seen_updates, self._count_updates):
            slots: list[int] = []
            ids: list[int] = []
            for slot, tokens in updates:
                slots += [slot] * len(tokens)
                ids += tokens
            out += [slots, ids]
        return out

    def apply(self, clear: Optional[torch.Tensor], seen: tuple, counted: tuple) -> None:
        """The uploaded updates into the tables (device work only; empty ones skipped on
        the host's knowledge of their sizes: the views of empty ones may be None)."""
        if self._clear:
            for table in (self.seen, self.counts):
                if table is not None:
                    table.index_fill_(0, clear, 0)
        if self._seen_updates:
            self.seen.index_put_(seen, self._true)
        if self._count_updates:
            self.counts.index_put_(counted, self._one, accumulate=True)

    # ------------------------------------------------------------------- slots
    def _ensure_tables(self, seen: bool, counts: bool) -> None:
        if not self.capacity:
            self.capacity = 1 + self.initial_slots
            self._free = list(range(self.capacity - 1, 0, -1))
        if seen and self.seen is None:
            self.seen = torch.zeros(self.capacity, self.vocab_size, dtype=torch.bool, device=self.device)
        if counts and self.counts is None:
            self.counts = torch.zeros(self.capacity, self.vocab_size, dtype=torch.float32, device=self.device)

    def _allocate(self) -> int:
        if not self._free:
            self._reclaim()
        if not self._free:
            self._grow()
        return self._free.pop()

    def _release(self, key: int) -> None:
        self._free.append(self._entries.pop(key).slot)

    def _reclaim(self) -> None:
        """Slots of finished (or preempted) or collected requests back to the free list,
        but never one this call gave out (a row of a request that ended while its step was
        in flight is still drawn from its slot); failing that, above max_slots, the least
        recently used slot not serving this call."""
        for key, e in list(self._entries.items()):
            r = e.ref()
            if r is None or (not r.running and e.used < self._call):
                self._release(key)
        if self._free or self.capacity - 1 < self.max_slots:
            return
        idle = [(e.used, key) for key, e in self._entries.items() if e.used < self._call]
        if idle:
            self._release(min(idle)[1])

    def _grow(self) -> None:
        old = self.capacity
        self.capacity = 2 * old - 1             # twice the usable slots
        for name in ("seen", "counts"):
            table = getattr(self, name)
            if table is not None:
                grown = torch.zeros(self.capacity, self.vocab_size, dtype=table.dtype, device=self.device)
                grown[:old].copy_(table)
                setattr(self, name, grown)
        self._free.extend(range(self.capacity - 1, old - 1, -1))

    @property
    def num_slots_in_use(self) -> int:
        return len(self._entries)
