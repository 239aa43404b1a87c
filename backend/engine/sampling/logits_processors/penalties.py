"""repetition_penalty (Hugging Face / CTRL: over prompt and output tokens), and
frequency_penalty and presence_penalty (OpenAI: over generated tokens), from per-request
token state kept on the device across steps (backend/engine/sampling/penalty_state.py): a
step costs O(batch + new tokens), never a walk over a request's prompt or output.

A verification row (spec_decode/rejection_sampler.VerifyRow) reads its request's state
plus its proposals before it, as if they were generated; a draft model's proposals stay
on the device (draft_tokens.device_fill)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from backend.engine.runner.buffers import GrowingStagedBuffer
from backend.engine.sampling.columns import FREQUENCY, PRESENCE, REPETITION
from backend.engine.sampling.logits_processors.base import TokenLogitsProcessor
from backend.engine.sampling.penalty_state import PenaltyState
from backend.engine.spec_decode.draft_tokens import device_fill, extend_staged


class PenaltyRows(NamedTuple):
    """A penalty's per-row token state: row i reads table[slots[i]] (slot 0: all
    zeros), plus `extra` (rows, token ids): the proposals a verification row counts as
    output on top of its request's state."""
    slots: torch.Tensor                         # int64 [B]
    table: torch.Tensor                         # [slots, V]: PenaltyState.seen or .counts
    extra: Optional[tuple[torch.Tensor, torch.Tensor]]


class Penalties(TokenLogitsProcessor):
    name = "penalties"

    def __init__(self, device: torch.device, max_num_seqs: int, staging_slots: int) -> None:
        super().__init__(device, max_num_seqs, staging_slots)
        self.state = PenaltyState(device, max_slots=max_num_seqs)
        # (one per penalty: a staging buffer rewritten within the step would wait for the device)
        self._draft_index = tuple(GrowingStagedBuffer(torch.int64, device) for _ in range(2))

    @classmethod
    def is_on(cls, row, params) -> bool:
        return row.repetition or row.counted

    def begin(self, vocab_size: int, num_rows: int) -> None:
        self.state.begin(vocab_size)
        self.num_rows = num_rows
        # Per penalty (repetition, counted): each row's slot (None: no row uses it), and
        # the proposals' (rows, ids), with where a draft model's go (on the device).
        self.slots: list[Optional[list[int]]] = [None, None]
        self.extra: list[tuple[list[int], list[int]]] = [([], []), ([], [])]
        self.on_device: tuple[list, list] = ([], [])
        self.any_counted = False

    def add_row(self, i: int, state, row) -> None:
        repetition, counted = row.repetition, row.counted
        request = getattr(state, "verified_request", None)
        proposed = state.proposed if request is not None else ()
        slot = self.state.slot(request if request is not None else state, repetition, counted)
        for k, used in enumerate((repetition, counted)):
            if used:
                if self.slots[k] is None:
                    self.slots[k] = [0] * self.num_rows
                self.slots[k][i] = slot
                if proposed:
                    self.extra[k][0].extend([i] * len(proposed))
                    extend_staged(self.extra[k][1], proposed, self.on_device[k])
        self.any_counted |= counted and state.num_output_tokens > 0

    def host_parts(self) -> list[list[int]]:
        if not self.any_counted:
            self.slots[1] = None                # nothing generated yet: counts are all zero
        return [*self.extra[0], *self.extra[1], self.slots[0] or [], self.slots[1] or [],
                *self.state.host_updates()]

    def take(self, views: list[Optional[torch.Tensor]]) -> Optional[tuple]:
        extra = []
        for k in (0, 1):
            rows, ids = views[2 * k], views[2 * k + 1]
            if self.on_device[k]:
                device_fill(ids, self.on_device[k], self._draft_index[k])
            extra.append((rows, ids) if self.extra[k][0] else None)
        clear, seen_slots, seen_ids, count_slots, count_ids = views[6:11]
        self.state.apply(clear, (seen_slots, seen_ids), (count_slots, count_ids))
        rows = tuple(PenaltyRows(views[4 + k], table, extra[k]) if self.slots[k] is not None else None
                     for k, table in enumerate((self.state.seen, self.state.counts)))
        return None if rows == (None, None) else rows

    def apply(self, logits: torch.Tensor, data: tuple, params: torch.Tensor) -> torch.Tensor:
        repetition, counted = data
        if repetition is not None:
            slots, table, extra = repetition
            seen = table.index_select(0, slots)
            if extra is not None:
                seen.index_put_(extra, torch.ones((), dtype=torch.bool, device=logits.device))
            rep = params[:, REPETITION:REPETITION + 1]
            penalized = torch.where(logits > 0, logits / rep, logits * rep)
            logits = torch.where(seen, penalized, logits)
        if counted is not None:
            slots, table, extra = counted
            counts = table.index_select(0, slots)
            if extra is not None:
                counts.index_put_(extra, torch.ones((), device=logits.device), accumulate=True)
            logits -= (params[:, FREQUENCY:FREQUENCY + 1] * counts
                       + params[:, PRESENCE:PRESENCE + 1] * (counts > 0).float())
        return logits
