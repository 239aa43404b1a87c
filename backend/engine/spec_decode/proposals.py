"""What a proposer hands the scheduler: its own module, so that the proposers, the
runner's outputs and the speculator each import it without importing one another."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class Proposals:
    """A proposer's result, which the scheduler applies (Scheduler.set_proposals)."""
    # By request id: (proposed tokens, the draft's distributions or None).
    tokens: dict[str, tuple[list[int], Optional[torch.Tensor]]] = field(default_factory=dict)
