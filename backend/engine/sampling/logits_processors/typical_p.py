"""typical_p: locally typical sampling (Meister et al., 2022; Hugging Face's
TypicalLogitsWarper). Keep the tokens whose surprisal is closest to the distribution's
entropy, in that order, until their mass reaches typical_p (at least one token)."""

from __future__ import annotations

import torch
from pydantic import Field

from backend.engine.sampling.logits_processors.base import LogitsProcessor


class TypicalP(LogitsProcessor):
    name = "typical_p"
    field = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    profile_value = 0.9

    def apply(self, probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        # In place where it can be: the memory profile runs this on the largest batch.
        p = probs / probs.sum(dim=-1, keepdim=True)
        entropy = torch.special.entr(p).sum(dim=-1, keepdim=True)      # -sum p log p (0 log 0 = 0)
        shifted = torch.log(p).neg_().sub_(entropy).abs_()             # inf where dropped: sorted last
        sorted_shifted, order = shifted.sort(dim=-1)
        cumulative = p.gather(1, order).cumsum_(dim=-1)
        del p, order
        # Hugging Face's rule: keep every token at most as far from the entropy as the
        # first one whose cumulative mass reaches typical_p (ties kept with it).
        last = (cumulative < values).sum(dim=-1, keepdim=True).clamp_(max=probs.shape[-1] - 1)
        del cumulative
        cutoff = sorted_shifted.gather(1, last)
        del sorted_shifted
        # A neutral row (1) keeps everything, even where rounding leaves its sum below 1.
        return probs.masked_fill((shifted > cutoff) & (values < 1.0), 0.0)
