"""Turn one step's logits into next tokens: one batched pass over [B, V].

Order of operations (as in vLLM): the token processors (logit bias, penalties, min_tokens
and bad words: backend/engine/sampling/logits_processors/), then greedy argmax or
temperature -> top-k -> top-p -> the distribution processors (min-p, typical-p) -> draw.
Per-row parameters travel as one [B, NUM_COLUMNS] tensor gathered on the device from rows
written once per distinct settings (sampling_table.py): a step uploads a slot id per row,
in the same one host-to-device copy as the token processors' index sets; features no
row uses cost nothing. Greedy rows ride in the same pass and take the argmax of the
processed logits.

Every tensor made here lives on the logits' device, and nothing here reads a device
value on the host: the caller does the step's one device-to-host copy of the ids.

Penalties read per-request token state kept on the device across steps
(backend/engine/sampling/penalty_state.py): preparing a step costs O(batch + new tokens),
never a walk over a request's prompt or output.

Draws use the exponential race, argmax(p / E) with E ~ Exp(1), which draws from p. The
noise comes from the sampler's own generator, except for rows whose request has a seed:
those draw from the request's generator (on the same device), so a seeded request gives
the same tokens whatever shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import is_
from typing import TYPE_CHECKING, Any, Collection, Optional, Sequence

import numpy as np
import torch

from backend.engine.runner.buffers import GrowingStagedBuffer
from backend.engine.sampling.columns import FIRST_PROCESSOR_COLUMN, TEMPERATURE, TOP_K, TOP_P
from backend.engine.sampling.logits_processors import PROCESSORS, TOKEN_PROCESSORS, TokenLogitsProcessor
from backend.engine.sampling.logits_processors.penalties import Penalties
from backend.engine.sampling.logprobs import LogprobRows
from backend.engine.sampling.penalty_state import PenaltyState
from backend.engine.sampling.sampling_row import SamplingRow
from backend.engine.sampling.sampling_table import SamplingTable
from backend.ops.cpu_argmax import argmax_rows

if TYPE_CHECKING:
    from backend.engine.runner.request_state import RequestState

NUM_COLUMNS = FIRST_PROCESSOR_COLUMN + len(PROCESSORS)


@dataclass
class SamplingBatch:
    """One step's sampling inputs, on the logits' device."""
    params: torch.Tensor                        # float32 [B, NUM_COLUMNS]
    all_greedy: bool
    any_greedy: bool
    max_top_k: int                              # 0: no row uses top-k
    any_top_p: bool
    processors: int                             # bit k: some sampled row turns PROCESSORS[k] on
    # The token processors some row uses, in TOKEN_PROCESSORS' order, with their step's data.
    token_processors: list[tuple[TokenLogitsProcessor, Any]]
    seeded: list[tuple[int, torch.Generator]]
    logprobs: Optional[LogprobRows] = None                    # rows whose request wants logprobs

    def token_data(self, name: str) -> Any:
        """The step's data of the token processor called `name` (None: no row uses it)."""
        return next((data for proc, data in self.token_processors if proc.name == name), None)


@dataclass
class _BatchRows:
    """The part of a step's sampling inputs that depends only on its rows (which request
    each is, in order), kept while the next steps have the same rows (Sampler.prepare)."""
    key: tuple                                  # the rows' objects, in order
    vocab_size: int
    params_rows: list[tuple] = field(default_factory=list)
    params: Optional[torch.Tensor] = None       # [B, NUM_COLUMNS], gathered once (read only after)
    n_greedy: int = 0
    max_top_k: int = 0
    any_top_p: bool = False
    processors: int = 0
    seeded: list[tuple[int, torch.Generator]] = field(default_factory=list)
    token_rows: list[tuple[int, SamplingRow]] = field(default_factory=list)   # rows using a token processor
    logprob_rows: list[int] = field(default_factory=list)
    logprob_counts: list[int] = field(default_factory=list)


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
        self.token_processors = [cls(self.device, max_num_seqs, staging_slots) for cls in TOKEN_PROCESSORS]
        self._rows: Optional[_BatchRows] = None

    @property
    def penalties(self) -> PenaltyState:
        """The penalties' per-request token state (logits_processors/penalties.py)."""
        return next(p for p in self.token_processors if isinstance(p, Penalties)).state

    @penalties.setter
    def penalties(self, state: PenaltyState) -> None:
        next(p for p in self.token_processors if isinstance(p, Penalties)).state = state

    # ------------------------------------------------------------------ host side
    def prepare(self, requests: Sequence["RequestState"], vocab_size: int) -> SamplingBatch:
        """Per-row parameters and index sets from the runner's request states
        (runner/request_state.py; a Request reads the same): host work only. What
        depends only on which requests the rows are, in which order (the parameters, the
        greedy, top-k, top-p and logits-processor summaries, seeded and logprob rows), is
        kept from the step before while the rows are the same (vLLM's persistent batch:
        rebuilt only when the batch changes): O(batch) on a change, O(rows using a token
        processor) otherwise, plus each such row's new tokens (a request's first sampled
        step: its prompt and output, once). A row may be a verification row
        (`verified_request`, `proposed`: see spec_decode/rejection_sampler.VerifyRow):
        the token processors read its request's state plus its proposals."""
        rows = self._rows
        if (rows is None or rows.params is None or rows.vocab_size != vocab_size  # (None: its call failed)
                or len(rows.key) != len(requests) or not all(map(is_, rows.key, requests))):    # (by identity)
            rows = self._rows = self._batch_rows(requests, vocab_size)
            flat = [self.rows.slots(rows.params_rows), self.rows.pending_slots(), rows.logprob_rows]
        else:
            flat = [[], [], rows.logprob_rows]
        token_processors = self.token_processors
        for proc in token_processors:
            proc.begin(vocab_size, len(requests))
        for i, row in rows.token_rows:
            r = requests[i]
            for k in row.token_processors:
                token_processors[k].add_row(i, r, row)
        # One upload: the rows' parameter slots (and new ones to write) on a change, the
        # logprob rows, and each token processor's lists.
        parts = [proc.host_parts() for proc in token_processors]
        for lists in parts:
            flat += lists
        views = self._upload(flat)
        if rows.params is None:
            self.rows.write_pending(views[1])
            rows.params = self.rows.gather(views[0], len(requests))
        logprobs = None
        if rows.logprob_rows:
            logprobs = LogprobRows(rows=views[2], counts=rows.logprob_counts, row_ids=rows.logprob_rows,
                                   max_count=min(max(rows.logprob_counts), vocab_size))
        used: list[tuple[TokenLogitsProcessor, Any]] = []
        offset = 3
        for proc, lists in zip(token_processors, parts):
            data = proc.take(views[offset:offset + len(lists)])
            offset += len(lists)
            if data is not None:
                used.append((proc, data))
        return SamplingBatch(
            params=rows.params, all_greedy=rows.n_greedy == len(requests), any_greedy=rows.n_greedy > 0,
            max_top_k=rows.max_top_k, any_top_p=rows.any_top_p, processors=rows.processors, token_processors=used,
            seeded=rows.seeded, logprobs=logprobs)

    @staticmethod
    def _batch_rows(requests: Sequence["RequestState"], vocab_size: int) -> "_BatchRows":
        """What the rows' settings give, walked once per batch (prepare)."""
        rows = _BatchRows(tuple(requests), vocab_size)
        for i, r in enumerate(requests):
            row = r.sampling_row            # (worked out at intake: sampling_row.py)
            if row is None or row.vocab_size != vocab_size:
                row = SamplingRow.of(r.sampling_params, r.eos_token_ids, vocab_size)
            rows.params_rows.append(row.params)
            if row.greedy:
                rows.n_greedy += 1
            else:
                if row.top_k > rows.max_top_k:
                    rows.max_top_k = row.top_k
                rows.any_top_p |= row.any_top_p
                rows.processors |= row.processors
                if r.generator is not None:
                    rows.seeded.append((i, r.generator))
            if row.token_processors:
                rows.token_rows.append((i, row))
            if row.logprobs is not None:
                rows.logprob_rows.append(i)
                rows.logprob_counts.append(row.logprobs)
        return rows

    def _upload(self, flat: list[list[int]]) -> list[Optional[torch.Tensor]]:
        """Each of `flat` as a device view, all in one host-to-device copy (no copy, and
        None views, when every list is empty)."""
        values: list[int] = []
        for part in flat:
            values += part
        if not values:
            return [None] * len(flat)
        dev = self._indices.upload(np.array(values, dtype=np.int64))
        views, off = [], 0
        for part in flat:
            views.append(dev[off:off + len(part)])
            off += len(part)
        return views

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
        if batch.token_processors:
            logits = logits.clone()             # the caller's logits also give the logprobs
            for proc, data in batch.token_processors:
                logits = proc.apply(logits, data, params)
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
