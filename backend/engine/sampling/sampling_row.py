"""A request's sampling settings as the sampler reads them every step, worked out once.

Settings never change over a request's life, so its row of the per-step parameter table
(backend/engine/sampling/sampler.py) and which index sets it joins (top-k, top-p, the logits
processors, the token processors: logit bias, penalties, min_tokens, bad words; logprobs)
are computed at intake. The sampler's per-row loop then reads one object instead of a
dozen attributes and comparisons: at 256 rows a step that loop is host time on the
engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from operator import attrgetter
from typing import Iterable, Optional

from backend.engine.sampling.logits_processors import PROCESSORS, TOKEN_PROCESSORS
from backend.sampling_params import SamplingParams

# Each processor's parameter and its off value, read per request (at intake, and by the
# sampler for a request without its row): one attrgetter call and a loop over pairs.
# ("temperature" last, dropped after: so that attrgetter returns a tuple even for one name.)
_PROCESSOR_VALUES = attrgetter(*(proc.name for proc in PROCESSORS), "temperature")
_NEUTRAL = tuple(proc.neutral for proc in PROCESSORS)

# top_p at or above 1 keeps everything; stored as 2 so that rounding in the cumulative
# sum can never drop a tail token of a row that asked for no top-p.
NO_TOP_P = 2.0


@dataclass(frozen=True, slots=True)
class SamplingRow:
    vocab_size: int
    # temperature, top_k, top_p, repetition, presence, frequency, then each logits
    # processor's parameter (sampler.py's columns)
    params: tuple[float, ...]
    greedy: bool
    top_k: int                          # 0: none (or not below the vocabulary)
    any_top_p: bool
    processors: int                     # bit k: PROCESSORS[k] is on for this request
    repetition: bool                    # repetition_penalty != 1
    counted: bool                       # presence or frequency penalty
    logprobs: Optional[int]
    bias_ids: tuple[int, ...]           # logit_bias, ids inside the vocabulary
    bias_values: tuple[float, ...]
    min_tokens: int
    min_tokens_banned: tuple[int, ...]  # stop ids and EOS (unless ignore_eos), below min_tokens
    token_processors: tuple[int, ...]   # the TOKEN_PROCESSORS this request uses, by index

    @classmethod
    def of(cls, p: SamplingParams, eos_token_ids: Iterable[int], vocab_size: int) -> "SamplingRow":
        top_k = p.top_k if 0 < p.top_k < vocab_size else 0
        bias_ids = tuple(t for t in p.logit_bias if 0 <= t < vocab_size) if p.logit_bias else ()
        stop = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        values = _PROCESSOR_VALUES(p)[:-1]
        processors = 0
        for k, (value, neutral) in enumerate(zip(values, _NEUTRAL)):
            if value != neutral:
                processors |= 1 << k
        row = cls(
            vocab_size=vocab_size,
            params=(p.temperature, top_k, p.top_p if p.top_p < 1.0 else NO_TOP_P,
                    p.repetition_penalty, p.presence_penalty, p.frequency_penalty, *values),
            greedy=p.greedy, top_k=top_k, any_top_p=p.top_p < 1.0, processors=processors,
            repetition=p.repetition_penalty != 1.0,
            counted=p.presence_penalty != 0.0 or p.frequency_penalty != 0.0,
            logprobs=p.logprobs, bias_ids=bias_ids, bias_values=tuple(p.logit_bias[t] for t in bias_ids),
            min_tokens=p.min_tokens,
            min_tokens_banned=tuple(sorted(t for t in stop if 0 <= t < vocab_size)) if p.min_tokens else (),
            token_processors=())
        # (the processors read the row's own fields: one rule for what turns each on)
        return replace(row, token_processors=tuple(k for k, proc in enumerate(TOKEN_PROCESSORS)
                                                   if proc.is_on(row, p)))
