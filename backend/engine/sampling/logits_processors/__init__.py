"""The logits processors the sampler runs, by name, in the order they apply (Hugging
Face's warper order). A new one: a module with a LogitsProcessor subclass, and a line
here. Its parameter then reaches SamplingParams, the OpenAI API (as an extra field, as
vLLM's extra_body sends it) and Triton's sampling_parameters with no other change."""

from __future__ import annotations

from typing import Any

from backend.engine.sampling.logits_processors.base import LogitsProcessor
from backend.engine.sampling.logits_processors.min_p import MinP
from backend.engine.sampling.logits_processors.typical_p import TypicalP

PROCESSORS: tuple[LogitsProcessor, ...] = (
    MinP(),
    TypicalP(),
)

def request_fields() -> dict[str, tuple[type, Any]]:
    """Each processor's parameter as a pydantic field definition (for create_model)."""
    return {p.name: (float, p.field) for p in PROCESSORS}
