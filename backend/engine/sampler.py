"""Turn one step's logits into next tokens.

Order of operations (as in vLLM): penalties, min_tokens masking, then greedy argmax or
temperature -> top-k -> top-p -> min-p -> draw. Draws use a per-request
torch.Generator when the request has a seed, so a seeded request gives the same tokens
whatever else shares its batch.
"""

from __future__ import annotations

from typing import Sequence

import torch

from backend.engine.request import Request


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """logits: [B, V] for the B requests, one row each."""
        logits = logits.float()
        if all(r.sampling_params.greedy and _no_processing(r) for r in requests):
            return logits.argmax(dim=-1).tolist()
        logits = logits.clone()
        for i, r in enumerate(requests):
            _apply_penalties(logits[i], r)
            _apply_min_tokens(logits[i], r)
        tokens: list[int] = []
        for i, r in enumerate(requests):
            tokens.append(self._sample_one(logits[i], r))
        return tokens

    def _sample_one(self, row: torch.Tensor, r: Request) -> int:
        p = r.sampling_params
        if p.greedy:
            return int(row.argmax())
        row = row / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest set whose mass reaches top_p (always at least one token).
            cum = sorted_probs.cumsum(0)
            drop_sorted = (cum - sorted_probs) >= p.top_p
            drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        gen = r.generator or self._generator
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, one draw per token.
        noise = torch.empty_like(probs).exponential_(generator=gen)
        return int((probs / noise).argmax())


def _no_processing(r: Request) -> bool:
    p = r.sampling_params
    return (p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and (p.min_tokens == 0 or r.num_output_tokens >= p.min_tokens))


def _apply_penalties(row: torch.Tensor, r: Request) -> None:
    p = r.sampling_params
    if p.repetition_penalty != 1.0:
        # Hugging Face / CTRL convention, over prompt and output tokens.
        seen = torch.tensor(sorted(set(r.all_token_ids)), dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and r.output_token_ids:
        # OpenAI convention, over generated tokens only.
        counts = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.long),
                                minlength=row.shape[0])[: row.shape[0]].float()
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


def _apply_min_tokens(row: torch.Tensor, r: Request) -> None:
    p = r.sampling_params
    if r.num_output_tokens < p.min_tokens:
        stop_ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            stop_ids |= r.eos_token_ids
        ids = [t for t in stop_ids if 0 <= t < row.shape[0]]
        if ids:
            row[ids] = float("-inf")
