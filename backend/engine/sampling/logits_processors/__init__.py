"""The logits processors the sampler runs, by name, in the order they apply.

TOKEN_PROCESSORS act on chosen tokens' logits of every row (greedy ones too), first, in
vLLM's order: logit bias, penalties, then the bans. PROCESSORS act on sampled rows'
distributions after temperature, top-k and top-p (Hugging Face's warper order).

A new distribution processor: a module with a LogitsProcessor subclass, and a line in
PROCESSORS. Its parameter then reaches SamplingParams, the OpenAI API (as an extra field,
as vLLM's extra_body sends it) and Triton's sampling_parameters with no other change. A
new token processor: a TokenLogitsProcessor subclass and a line in TOKEN_PROCESSORS (its
parameters are SamplingParams fields; what it reads per row comes from the SamplingRow
or the RequestState)."""

from __future__ import annotations

from typing import Any

from backend.engine.sampling.logits_processors.bad_words import BadWordsBan
from backend.engine.sampling.logits_processors.base import LogitsProcessor, TokenLogitsProcessor
from backend.engine.sampling.logits_processors.logit_bias import LogitBias
from backend.engine.sampling.logits_processors.min_p import MinP
from backend.engine.sampling.logits_processors.min_tokens import MinTokens
from backend.engine.sampling.logits_processors.penalties import Penalties
from backend.engine.sampling.logits_processors.typical_p import TypicalP

# Classes: each sampler makes its own (a processor may keep device state across steps).
TOKEN_PROCESSORS: tuple[type[TokenLogitsProcessor], ...] = (
    LogitBias,
    Penalties,
    MinTokens,
    BadWordsBan,
)

PROCESSORS: tuple[LogitsProcessor, ...] = (
    MinP(),
    TypicalP(),
)

def request_fields() -> dict[str, tuple[type, Any]]:
    """Each processor's parameter as a pydantic field definition (for create_model)."""
    return {p.name: (float, p.field) for p in PROCESSORS}
