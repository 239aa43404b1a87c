"""A step as rank 0 sends it to the other ranks (backend/parallel/workers.py, rank.py):
the runner's journal since the last step (the typed steps applied, as
`SchedulerOutput.for_ranks` gives them: RankStepData, and the tokens it sampled), whose
last entry is the step to run, and each scheduled request's LoRA adapter.

It travels as pickled bytes on the control group. The bytes come from rank 0 of the same
deployment; still, reading them can only make the classes a step holds
(`_STEP_CLASSES`) and Python's own containers and numbers: a message naming anything
else is refused, so the control group's peers cannot make a rank run code.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Optional

import torch

from backend.engine.scheduling import sched_output

_STEP_CLASSES = {(sched_output.__name__, cls.__name__): cls
                 for cls in (sched_output.RankStepData, sched_output.NewRequestData)}


@dataclass
class RankStep:
    journal: list                           # RequestStates.take_journal(): ends with the step
    lora_ids: Optional[list[int]] = None    # per scheduled request: its index in lora_modules (-1: base)


class _StepUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        cls = _STEP_CLASSES.get((module, name))
        if cls is None:
            raise pickle.UnpicklingError(f"a step message may not hold {module}.{name}")
        return cls


def encode(step: RankStep) -> torch.Tensor:
    """The step as a uint8 tensor (what the control group broadcasts)."""
    data = pickle.dumps((step.journal, step.lora_ids), protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode(payload: torch.Tensor) -> RankStep:
    journal, lora_ids = _StepUnpickler(io.BytesIO(payload.numpy().tobytes())).load()
    return RankStep(journal, lora_ids)
