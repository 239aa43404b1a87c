"""The interfaces a sampling parameter implements to act on each step's logits: on the
distribution of sampled rows (LogitsProcessor: min-p, typical-p), or on chosen tokens'
logits of every row (TokenLogitsProcessor, below: logit bias, penalties, min_tokens,
bad words).

A logits processor owns one request parameter. Its name and pydantic field (default and
bounds) join SamplingParams and the OpenAI request models, so the parameter is validated
once, at the edge, with errors that name it, and needs no code of its own there. At
intake the sampler puts each request's value in one column of its per-row parameter
table (backend/engine/sampling/sampling_row.py), so a step costs one upload whatever the number
of processors. A processor runs in a step only when one of its sampled rows turns it on
(a value other than the field's default); greedy rows never reach it.

It runs on the distribution after temperature, top-k and top-p, in the registry's order
(backend/engine/sampling/logits_processors/__init__.py), which is Hugging Face's warper order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import torch
from pydantic.fields import FieldInfo

if TYPE_CHECKING:
    from backend.engine.sampling.sampling_row import SamplingRow
    from backend.sampling_params import SamplingParams


class LogitsProcessor(ABC):
    name: ClassVar[str]                 # the request parameter (vLLM's / Hugging Face's name)
    field: ClassVar[FieldInfo]          # its pydantic Field: the default turns the processor off
    profile_value: ClassVar[float]      # a value that turns it on, for the memory profile's batch

    @property
    def neutral(self) -> float:
        return float(self.field.default)

    def is_on(self, value: float) -> bool:
        return value != self.neutral

    @abstractmethod
    def apply(self, probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """probs [B, V] float32, unnormalised, 0 where a token is already dropped; values
        [B, 1] float32, this parameter per row. Returns the distribution with the tokens
        this processor drops set to 0. A row whose value is neutral comes out unchanged,
        bit for bit. Every tensor on probs' device; nothing read back to the host."""


class TokenLogitsProcessor(ABC):
    """A request parameter that changes chosen tokens' logits on each row it is on,
    greedy rows included (it can move the argmax), before temperature: vLLM's
    non-argmax-invariant logits processors (logit bias, min_tokens), and the penalties
    and bad words. Its per-row data are token ids, gathered on the host each step for
    the rows that use it and sent in the sampler's one host-to-device copy of int64
    lists (other payloads, such as logit_bias's float values, are its own upload).

    One instance per sampler (it may keep device state across steps, as the penalties
    do). A step: begin, add_row for each row whose request uses it (is_on, worked out
    at intake in its SamplingRow), host_parts, then take with their device views; apply
    runs in the distributions pass when take returned data. Nothing here reads a device
    value on the host."""
    name: ClassVar[str]                 # the request parameter (or the processor's own name)

    def __init__(self, device: torch.device, max_num_seqs: int, staging_slots: int) -> None:
        self.device = device

    @classmethod
    @abstractmethod
    def is_on(cls, row: "SamplingRow", params: "SamplingParams") -> bool:
        """Whether a request with these settings uses it (once, at intake): from its
        SamplingRow's fields where they say it, else from its params."""

    @abstractmethod
    def begin(self, vocab_size: int, num_rows: int) -> None:
        """A step's preparation starts."""

    @abstractmethod
    def add_row(self, i: int, state, row: "SamplingRow") -> None:
        """Row i of the step (a RequestState, or a verification row: VerifyRow) uses it."""

    @abstractmethod
    def host_parts(self) -> list[list[int]]:
        """Its int64 lists for the step's one upload (empty ones included)."""

    @abstractmethod
    def take(self, views: list[Optional[torch.Tensor]]) -> Optional[Any]:
        """The device views of host_parts, in their order (a view of an empty list may
        be None): the step's data for apply, or None when no row needs it."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, data: Any, params: torch.Tensor) -> torch.Tensor:
        """logits [B, V] float32, the sampler's private copy (in place is fine); params
        the per-row parameter table [B, NUM_COLUMNS]. Returns the logits."""
