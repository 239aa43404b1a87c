"""The engine's former per-row sampler, kept as the reference the batched one is tested
against: the distribution each row's processing defines (penalties, min_tokens,
temperature, top-k, top-p, min-p), one row at a time, in plain torch."""

from __future__ import annotations

import torch

from backend.engine.runner.request_state import RequestState


def processed_logits(row: torch.Tensor, r: RequestState) -> torch.Tensor:
    """Penalties and min_tokens masking, as the per-row sampler applied them."""
    row = row.float().clone()
    p = r.sampling_params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(r.all_token_ids)), dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and r.output_token_ids:
        counts = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.long),
                                minlength=row.shape[0])[: row.shape[0]].float()
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    if r.num_output_tokens < p.min_tokens:
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
        ids = [t for t in stop_ids if 0 <= t < row.shape[0]]
        if ids:
            row[ids] = float("-inf")
    return row


def target_probs(row: torch.Tensor, r: RequestState) -> torch.Tensor:
    """The distribution the per-row sampler drew from (one-hot for greedy)."""
    p = r.sampling_params
    row = processed_logits(row, r)
    if p.greedy:
        return torch.nn.functional.one_hot(row.argmax(), row.shape[0]).float()
    row = row / p.temperature
    if 0 < p.top_k < row.shape[0]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cum = sorted_probs.cumsum(0)
        drop_sorted = (cum - sorted_probs) >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()
