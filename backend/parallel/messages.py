"""The control messages rank 0 sends the other ranks (backend/parallel/workers.py,
rank.py): one at a time, broadcast on the control group as a fixed-width int64 header,
the message's kind, then its fields."""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from backend.engine.runner.step_inputs import GraphShape


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
class StepMessage(_IntFields):
    """Run one step: its payload (step_payload.py, `payload_len` bytes: the typed steps
    since the last one and the step's adapters) follows; each rank builds the step's
    inputs from it, checks them against rank 0's (`inputs_digest`:
    StepInputBuilder.digest), then runs the forward, as `graph` (the CUDA graph rank 0
    replays) or eagerly (graph 0 x 0)."""
    payload_len: int
    inputs_digest: int = 0
    graph_num_seqs: int = 0
    graph_query_len: int = 0

    @classmethod
    def of(cls, payload_len: int, inputs_digest: int, graph: Optional[GraphShape]) -> "StepMessage":
        return cls(payload_len, inputs_digest, *(graph or (0, 0)))

    @property
    def graph(self) -> Optional[GraphShape]:
        return GraphShape(self.graph_num_seqs, self.graph_query_len) if self.graph_num_seqs else None


Message = Union[StopMessage, SetupMessage, CaptureMessage, StepMessage, StageTimesMessage]
_KINDS: tuple[type, ...] = (StopMessage, SetupMessage, StepMessage, CaptureMessage, StageTimesMessage)
HEADER_LEN = 1 + max(len(dataclasses.fields(k)) for k in _KINDS)


def encode(message: Message) -> torch.Tensor:
    """The message as the fixed-width header broadcast on the control group."""
    values = [_KINDS.index(type(message)), *message.values()]
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[:len(values)] = torch.tensor(values, dtype=torch.int64)
    return header


def decode(header: torch.Tensor) -> Message:
    kind, *values = header.tolist()
    return _KINDS[kind].from_values(values)
