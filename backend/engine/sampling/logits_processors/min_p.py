"""min_p: drop tokens less likely than min_p times the most likely one (vLLM's and
Hugging Face's MinPLogitsWarper)."""

from __future__ import annotations

import torch
from pydantic import Field

from backend.engine.sampling.logits_processors.base import LogitsProcessor


class MinP(LogitsProcessor):
    name = "min_p"
    field = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    profile_value = 0.01

    def apply(self, probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        # A neutral row (0) drops nothing: no probability is below 0.
        return probs.masked_fill(probs < values * probs.amax(dim=-1, keepdim=True), 0.0)
