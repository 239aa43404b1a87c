"""Turn one step's logits into next tokens: one batched pass over [B, V].

Order of operations (as in vLLM): logit bias, penalties, min_tokens and bad words masking,
then greedy argmax or temperature -> top-k -> top-p -> the logits processors
(backend/engine/logits_processors: min-p, ...) -> draw. Per-row parameters travel as one
[B, NUM_COLUMNS] tensor gathered on the device from rows written once per distinct
settings (sampling_table.py): a step uploads a slot id per row, in the same one
host-to-device copy as its index sets; features no row uses cost nothing.
Greedy rows ride in the same pass and take the argmax of the penalized logits.

Every tensor made here lives on the logits' device, and nothing here reads a device
value on the host: the caller does the step's one device-to-host copy of the ids.

Penalties read per-request token state kept on the device across steps
(backend/engine/sampling/penalty_state.py): preparing a step costs O(batch + new tokens), never
a walk over a request's prompt or output.

Draws use the exponential race, argmax(p / E) with E ~ Exp(1), which draws from p. The
noise comes from the sampler's own generator, except for rows whose request has a seed:
those draw from the request's generator (on the same device), so a seeded request gives
the same tokens whatever shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Collection, NamedTuple, Optional, Sequence

import numpy as np
import torch

from backend.engine.runner.buffers import GrowingStagedBuffer
from backend.engine.sampling.logits_processors import PROCESSORS
from backend.engine.sampling.logprobs import LogprobRows
from backend.engine.sampling.penalty_state import PenaltyState
from backend.engine.sampling.sampling_row import SamplingRow
from backend.engine.sampling.sampling_table import SamplingTable
from backend.engine.spec_decode.draft_tokens import device_fill, extend_staged
from backend.ops.cpu_argmax import argmax_rows

if TYPE_CHECKING:
    from backend.engine.runner.request_state import RequestState

# Columns of the per-row parameter tensor; logits processor k reads column
# FIRST_PROCESSOR_COLUMN + k.
TEMPERATURE, TOP_K, TOP_P, REPETITION, PRESENCE, FREQUENCY = range(6)
FIRST_PROCESSOR_COLUMN = 6
NUM_COLUMNS = FIRST_PROCESSOR_COLUMN + len(PROCESSORS)


class PenaltyRows(NamedTuple):
    """A penalty's per-row token state: row i reads table[slots[i]] (slot 0: all
    zeros), plus `extra` (rows, token ids): the proposals a verification row counts as
    output on top of its request's state."""
    slots: torch.Tensor                         # int64 [B]
    table: torch.Tensor                         # [slots, V]: PenaltyState.seen or .counts
    extra: Optional[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class SamplingBatch:
    """One step's sampling inputs, on the logits' device."""
    params: torch.Tensor                        # float32 [B, NUM_COLUMNS]
    all_greedy: bool
    any_greedy: bool
    max_top_k: int                              # 0: no row uses top-k
    any_top_p: bool
    processors: int                             # bit k: some sampled row turns PROCESSORS[k] on
    repetition: Optional[PenaltyRows]           # prompt and output tokens seen
    counted: Optional[PenaltyRows]              # output tokens generated, counted
    banned: Optional[tuple[torch.Tensor, torch.Tensor]]       # min_tokens, bad words: (rows, token ids)
    seeded: list[tuple[int, torch.Generator]]
    logprobs: Optional[LogprobRows] = None                    # rows whose request wants logprobs
    bias: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # logit_bias: rows, ids, values


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device = torch.device("cpu"), max_num_seqs: int = 256,
                 staging_slots: int = 1) -> None:
        """staging_slots: host buffers used in turn (buffers.py), for a sampler that
        prepares several draws a step (the draft model's)."""
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # Each distinct settings row on the device, written once (sampling_table.py).
        self.rows = SamplingTable(NUM_COLUMNS, self.device, max(64, 2 * max_num_seqs), staging_slots)
        self._indices = GrowingStagedBuffer(torch.int64, self.device, slots=staging_slots)
        self._bias_values = GrowingStagedBuffer(torch.float32, self.device, slots=staging_slots)
        # (one per penalty: a staging buffer rewritten within the step would wait for the device)
        self._draft_index = tuple(GrowingStagedBuffer(torch.int64, self.device) for _ in range(2))
        self.penalties = PenaltyState(self.device, max_slots=max_num_seqs)

    # ------------------------------------------------------------------ host side
    def prepare(self, requests: Sequence["RequestState"], vocab_size: int) -> SamplingBatch:
        """Per-row parameters and index sets from the runner's request states
        (runner/request_state.py; a Request reads the same): host work only, O(batch)
        plus each row's new tokens (a request's first sampled step: its prompt and output,
        once). A row may be a verification row (`verified_request`, `proposed`: see
        spec_decode/rejection_sampler.VerifyRow): it reads its request's state plus its
        proposals."""
        B = len(requests)
        params_rows: list[tuple] = []
        # Index sets as flat (rows, ids) lists: repetition proposals, counted proposals,
        # banned ids (min_tokens, bad words), logprobs (row, its count), logit_bias ids.
        index_sets: list[tuple[list[int], list[int]]] = [([], []) for _ in range(5)]
        rep_extra, cnt_extra, banned, want_logprobs, biased = index_sets
        # A draft model's proposals stay on the device: (place in the set's ids, tokens).
        on_device: tuple[list, list] = ([], [])
        bias_values: list[float] = []
        seeded: list[tuple[int, torch.Generator]] = []
        n_greedy = max_top_k = 0
        any_top_p = False
        processors = 0
        penalties = self.penalties
        penalties.begin(vocab_size)
        slots: list[Optional[list[int]]] = [None, None]       # per row: repetition, counted
        any_counted = False
        for i, r in enumerate(requests):
            row = r.sampling_row            # (worked out at intake: sampling_row.py)
            if row is None or row.vocab_size != vocab_size:
                row = SamplingRow.of(r.sampling_params, r.eos_token_ids, vocab_size)
            params_rows.append(row.params)
            if row.greedy:
                n_greedy += 1
            else:
                if row.top_k > max_top_k:
                    max_top_k = row.top_k
                any_top_p |= row.any_top_p
                processors |= row.processors
                if r.generator is not None:
                    seeded.append((i, r.generator))
            repetition, counted = row.repetition, row.counted
            if repetition or counted:
                request = getattr(r, "verified_request", None)
                proposed = r.proposed if request is not None else ()
                slot = penalties.slot(request if request is not None else r, repetition, counted)
                for k, used in enumerate((repetition, counted)):
                    if used:
                        if slots[k] is None:
                            slots[k] = [0] * B
                        slots[k][i] = slot
                        if proposed:
                            index_sets[k][0].extend([i] * len(proposed))
                            extend_staged(index_sets[k][1], proposed, on_device[k])
                any_counted |= counted and r.num_output_tokens > 0
            if r.bad_words is not None:         # the words' own tokens, never the context
                ids = r.bad_words.banned(r)
                banned[0].extend([i] * len(ids))
                banned[1].extend(ids)
            if row.min_tokens and r.num_output_tokens < row.min_tokens:
                banned[0].extend([i] * len(row.min_tokens_banned))
                banned[1].extend(row.min_tokens_banned)
            if row.logprobs is not None:
                want_logprobs[0].append(i)
                want_logprobs[1].append(row.logprobs)
            if row.bias_ids:
                biased[0].extend([i] * len(row.bias_ids))
                biased[1].extend(row.bias_ids)
                bias_values += row.bias_values
        if not any_counted:
            slots[1] = None                     # nothing generated yet: counts are all zero
        # One upload: the index sets, the rows' parameter slots (and new ones to write),
        # the rows' penalty slots, the penalty state's updates.
        flat = [self.rows.slots(params_rows), self.rows.pending_slots(), *(s for s in slots if s is not None),
                *penalties.host_updates()]
        uploaded, dev = self._upload_indices(index_sets, flat)
        for k in (0, 1):
            if on_device[k]:
                device_fill(uploaded[k][1], on_device[k], self._draft_index[k])
        self.rows.write_pending(dev[1])
        params = self.rows.gather(dev[0], B)
        slot_views, (clear, seen_slots, seen_ids, count_slots, count_ids) = dev[2:len(dev) - 5], dev[-5:]
        penalties.apply(clear, (seen_slots, seen_ids), (count_slots, count_ids))
        penalty_rows: list[Optional[PenaltyRows]] = [None, None]
        for k, table in enumerate((penalties.seen, penalties.counts)):
            if slots[k] is not None:
                penalty_rows[k] = PenaltyRows(slot_views.pop(0), table, uploaded[k])
        logprobs = None
        if uploaded[3] is not None:
            counts = want_logprobs[1]
            logprobs = LogprobRows(rows=uploaded[3][0], counts=counts, row_ids=want_logprobs[0],
                                   max_count=min(max(counts), vocab_size))
        bias = None
        if uploaded[4] is not None:
            bias = (*uploaded[4], self._bias_values.upload(np.asarray(bias_values, dtype=np.float32)))
        return SamplingBatch(
            bias=bias,
            params=params,
            all_greedy=n_greedy == B, any_greedy=n_greedy > 0, max_top_k=max_top_k,
            any_top_p=any_top_p, processors=processors, repetition=penalty_rows[0], counted=penalty_rows[1],
            banned=uploaded[2], seeded=seeded, logprobs=logprobs)

    def _upload_indices(self, index_sets: list[tuple[list[int], list[int]]], flat: list[list[int]]
                        ) -> tuple[list[Optional[tuple[torch.Tensor, torch.Tensor]]], list[torch.Tensor]]:
        """Each index set as device (rows, ids), None for an empty one, and each of `flat`
        as a device view: all in one host-to-device copy."""
        values: list[int] = []
        for rows, ids in index_sets:
            values += rows
            values += ids
        for part in flat:
            values += part
        if not values:
            return [None] * len(index_sets), [None] * len(flat)     # nothing to send: no copy
        dev = self._indices.upload(np.array(values, dtype=np.int64))
        out, off = [], 0
        for rows, _ in index_sets:
            n = len(rows)
            out.append((dev[off:off + n], dev[off + n:off + 2 * n]) if n else None)
            off += 2 * n
        views = []
        for part in flat:
            views.append(dev[off:off + len(part)])
            off += len(part)
        return out, views

    # ---------------------------------------------------------------- device side
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [B, V] -> next token ids [B] (int64, on the logits' device)."""
        return self.sample_with_distributions(logits, batch)[0]

    def sample_with_distributions(self, logits: torch.Tensor, batch: SamplingBatch
                                  ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(next token ids [B], the distributions the sampled rows drew from, as
        distributions() gives them, or None when every row is greedy)."""
        logits, probs = self.distributions(logits, batch)
        if probs is None:
            return argmax_rows(logits), None
        sampled = self.draw(probs, batch)
        if batch.any_greedy:
            sampled = torch.where(batch.params[:, TEMPERATURE] == 0.0, argmax_rows(logits), sampled)
        return sampled, probs

    def distributions(self, logits: torch.Tensor, batch: SamplingBatch
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(the biased and penalized logits [B, V] float32, whose argmax a greedy row takes;
        the distribution each sampled row draws from [B, V], after temperature, top-k,
        top-p and the logits processors, or None when every row is greedy). Greedy rows' distributions
        are computed at temperature 1 and mean nothing."""
        logits = logits.float()
        params = batch.params
        penalized = batch.repetition is not None or batch.counted is not None or batch.banned is not None
        if batch.bias is not None or penalized:
            logits = logits.clone()             # the caller's logits also give the logprobs
            if batch.bias is not None:
                rows, ids, values = batch.bias
                logits.index_put_((rows, ids), values, accumulate=True)
            if penalized:
                logits = apply_penalties(logits, batch)
        if batch.all_greedy:
            return logits, None
        temperature = params[:, TEMPERATURE:TEMPERATURE + 1]
        x = logits / torch.where(temperature == 0.0, 1.0, temperature)
        if batch.max_top_k:
            x = apply_top_k(x, params[:, TOP_K], batch.max_top_k)
        probs = torch.softmax(x, dim=-1)
        if batch.any_top_p:
            probs = apply_top_p(probs, params[:, TOP_P:TOP_P + 1])
        if batch.processors:
            for k, processor in enumerate(PROCESSORS):
                if batch.processors >> k & 1:
                    column = FIRST_PROCESSOR_COLUMN + k
                    probs = processor.apply(probs, params[:, column:column + 1])
        return logits, probs

    def noise(self, like: torch.Tensor, batch: SamplingBatch, kind: str = "exponential",
              skip_seeded: Collection[int] = ()) -> torch.Tensor:
        """Per-row random numbers shaped like `like` ([B, N]): Exp(1) or U[0, 1), from the
        sampler's generator except on seeded rows, which use their request's (but not the
        rows in `skip_seeded`, whose numbers go unused: their generators stay put)."""
        out = torch.empty_like(like, dtype=torch.float32)
        fill = (lambda t, g: t.exponential_(generator=g)) if kind == "exponential" else \
            (lambda t, g: t.uniform_(generator=g))
        fill(out, self.generator)
        for row, gen in batch.seeded:
            if row not in skip_seeded:
                fill(out[row], gen)
        return out

    def draw(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """One token per row from `probs` (unnormalised is fine): the exponential race."""
        return argmax_rows(probs / self.noise(probs, batch))


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """In place on a private copy: repetition (Hugging Face / CTRL convention, over prompt
    and output tokens), frequency and presence (OpenAI convention, over generated tokens),
    then the banned ids: min_tokens' stop ids and EOS, bad words (backend/engine/sampling/bad_words.py)."""
    params = batch.params
    if batch.repetition is not None:
        slots, table, extra = batch.repetition
        seen = table.index_select(0, slots)
        if extra is not None:
            seen.index_put_(extra, torch.ones((), dtype=torch.bool, device=logits.device))
        rep = params[:, REPETITION:REPETITION + 1]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    if batch.counted is not None:
        slots, table, extra = batch.counted
        counts = table.index_select(0, slots)
        if extra is not None:
            counts.index_put_(extra, torch.ones((), device=logits.device), accumulate=True)
        logits -= (params[:, FREQUENCY:FREQUENCY + 1] * counts
                   + params[:, PRESENCE:PRESENCE + 1] * (counts > 0).float())
    if batch.banned is not None:
        logits.index_put_(batch.banned, torch.full((), float("-inf"), device=logits.device))
    return logits


def apply_top_k(x: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's top_k largest (ties with the k-th kept); rows with top_k 0 keep all.
    One topk at the batch's largest k, then each row's own k-th value."""
    values = torch.topk(x, max_top_k, dim=-1).values
    k = top_k.long().clamp(min=1)
    kth = values.gather(1, (k - 1).clamp(max=max_top_k - 1)[:, None])
    kth = torch.where(top_k[:, None] > 0, kth, float("-inf"))
    return x.masked_fill(x < kth, float("-inf"))


def apply_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least
    one token); top_p [B, 1]."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
    drop_sorted[:, 0] = False       # the most likely token stays, even for a top_p that is 0 in float32
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
    return probs.masked_fill(drop, 0.0)
