"""The control messages rank 0 sends the other ranks (backend/parallel/workers.py,
rank.py): one at a time, broadcast on the control group as a fixed-width int64 header,
the message's kind, then its fields."""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from backend.engine.runner.step_inputs import GraphShape, StepInputBuilder


class _IntFields:
    """A message whose fields are ints, sent in declaration order."""

    def values(self) -> list[int]:
        return list(dataclasses.astuple(self))

    @classmethod
    def from_values(cls, values: list[int]):
        return cls(*values[:len(dataclasses.fields(cls))])


@dataclasses.dataclass(frozen=True)
class StopMessage(_IntFields):
    """Exit."""


@dataclasses.dataclass(frozen=True)
class SetupMessage(_IntFields):
    """The KV pool and step buffer sizes rank 0 chose; the workers answer with their
    (weight bytes, KV bytes)."""
    num_kv_blocks: int
    block_size: int
    max_tokens: int
    max_seqs: int
    max_blocks_per_seq: int


@dataclasses.dataclass(frozen=True)
class CaptureMessage(_IntFields):
    """Capture the decode (and verify) CUDA graphs (every rank at once; kept only if all
    succeed)."""
    max_num_seqs: int
    max_model_len: int
    verify_query_len: int = 0


@dataclasses.dataclass(frozen=True)
class StageTimesMessage(_IntFields):
    """Pipeline parallelism: every rank answers (gather) with the nanoseconds it waited on
    other ranks and the nanoseconds since its timers were last reset; then resets them
    if `reset`."""
    reset: int = 0


@dataclasses.dataclass(frozen=True)
class StepMessage:
    """Run one step. The uploaded buffer prefix follows (plan[0] elements), then, with
    LoRA, each scheduled request's adapter index."""
    plan: tuple[int, ...]           # StepInputBuilder.plan(step)
    graph: Optional[GraphShape]     # the CUDA graph rank 0 replays; None: eager
    with_lora: bool = False

    WIDTH = StepInputBuilder.PLAN_LEN + 3

    def __post_init__(self) -> None:
        assert len(self.plan) == StepInputBuilder.PLAN_LEN, self.plan

    def values(self) -> list[int]:
        g = self.graph or GraphShape(0, 0)
        return [*self.plan, g.num_seqs, g.query_len, int(self.with_lora)]

    @classmethod
    def from_values(cls, values: list[int]) -> "StepMessage":
        n = StepInputBuilder.PLAN_LEN
        graph = GraphShape(values[n], values[n + 1]) if values[n] else None
        return cls(tuple(values[:n]), graph, bool(values[n + 2]))


Message = Union[StopMessage, SetupMessage, CaptureMessage, StepMessage, StageTimesMessage]
_KINDS: tuple[type, ...] = (StopMessage, SetupMessage, StepMessage, CaptureMessage, StageTimesMessage)
HEADER_LEN = 1 + max(StepMessage.WIDTH, *(len(dataclasses.fields(k)) for k in _KINDS if k is not StepMessage))


def encode(message: Message) -> torch.Tensor:
    """The message as the fixed-width header broadcast on the control group."""
    values = [_KINDS.index(type(message)), *message.values()]
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[:len(values)] = torch.tensor(values, dtype=torch.int64)
    return header


def decode(header: torch.Tensor) -> Message:
    kind, *values = header.tolist()
    return _KINDS[kind].from_values(values)
