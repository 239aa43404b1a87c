"""The interface a sampling parameter implements to act on each step's distributions.

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
from typing import ClassVar

import torch
from pydantic.fields import FieldInfo


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
