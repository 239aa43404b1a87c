"""Per-token log probabilities, for requests that ask (`SamplingParams.logprobs`).

As vLLM v1 (its default `raw_logprobs`): from the model's logits before penalties,
temperature and truncation, so they describe the model, not the sampling settings. Each
generated token gets its own log probability and rank (1 = the model's top choice) and
the `logprobs` most likely tokens with theirs.

Device side, only over the rows that asked: one log-softmax, a gather, a count for the
rank and a top-k, packed with the step's sampled ids into one float32 tensor, so that
the step keeps its single device-to-host copy. float32 holds token ids exactly up to
2**24, far above any vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(slots=True)       # (slots: hundreds are made a step; cheaper to create)
class Logprob:
    logprob: float
    rank: int
    decoded_token: Optional[str] = None


# One generated token: {token id: Logprob}, the sampled token first, then the top ones.
TokenLogprobs = dict[int, Logprob]


@dataclass
class LogprobRows:
    """Which rows of the step want logprobs, on the logits' device, and how many top
    tokens each (host side too, for unpacking)."""
    rows: torch.Tensor          # int64 [L]
    counts: list[int]           # per listed row: its `logprobs` (top tokens)
    row_ids: list[int]          # the same rows, on the host
    max_count: int


def pack_rows(logits: torch.Tensor, targets: torch.Tensor, max_k: int) -> torch.Tensor:
    """logits [N, V] and each row's target id [N] -> per row, flat: the target's logprob,
    its rank, the top max_k logprobs and their ids (float32; ids are exact below 2**24).
    What generated tokens and prompt tokens (prompt_logprobs.py) both send."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen_lp = lp.gather(1, targets[:, None])
    rank = (lp > chosen_lp).sum(dim=-1, keepdim=True) + 1
    parts = [chosen_lp, rank.float()]
    if max_k:
        top_lp, top_ids = lp.topk(max_k, dim=-1)
        parts += [top_lp, top_ids.float()]
    return torch.cat(parts, dim=1).flatten()


def unpack_row(values: list[float], base: int, target: int, count: int, max_k: int) -> TokenLogprobs:
    """One row of `pack_rows`' host copy, starting at `base`: the target first, then the
    row's `count` most likely tokens (a target among them keeps its own entry)."""
    entry = {target: Logprob(values[base], int(values[base + 1]))}
    top_lp = values[base + 2:base + 2 + count]
    top_ids = values[base + 2 + max_k:base + 2 + max_k + count]
    for rank, (tid, lpv) in enumerate(zip(top_ids, top_lp), start=1):
        entry.setdefault(int(tid), Logprob(lpv, rank))
    return entry


def pack(logits: torch.Tensor, sampled: torch.Tensor, want: Optional[LogprobRows]) -> torch.Tensor:
    """sampled ids [B], then per listed row: its logprob, rank, top-k logprobs, top-k ids."""
    if want is None:
        return sampled
    rows = pack_rows(logits.index_select(0, want.rows), sampled.index_select(0, want.rows), want.max_count)
    return torch.cat([sampled.float(), rows])


def packed_len(num_rows: int, want: Optional[LogprobRows]) -> int:
    """The length of `pack`'s result."""
    return num_rows + (len(want.row_ids) * (2 + 2 * want.max_count) if want is not None else 0)


def unpack(values: list[float], num_rows: int, want: Optional[LogprobRows]
           ) -> tuple[list[int], dict[int, TokenLogprobs]]:
    """The host copy of `pack` -> (sampled ids, {row: that row's TokenLogprobs})."""
    tokens = [int(v) for v in values[:num_rows]]
    if want is None:
        return tokens, {}
    width = 2 + 2 * want.max_count
    return tokens, {row: unpack_row(values, num_rows + j * width, tokens[row], count, want.max_count)
                    for j, (row, count) in enumerate(zip(want.row_ids, want.counts))}
