"""Sampling one batch outside the engine (the runner prepares, samples and copies back
in separate places)."""

from __future__ import annotations

from typing import Sequence

import torch

from backend.engine.runner.request_state import RequestState
from backend.engine.sampling.sampler import Sampler


def sample_ids(sampler: Sampler, logits: torch.Tensor, requests: Sequence[RequestState]) -> list[int]:
    """Prepare the batch, sample one token per row and copy the ids back."""
    return sampler.sample(logits, sampler.prepare(requests, logits.shape[-1])).tolist()
