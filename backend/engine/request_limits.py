"""Per-request limits, from the engine arguments of the same names.

Checked once per request, before it is fanned out (n) or queued: a request over a limit
is refused alone with an InvalidRequestError that names the field and the limit, and
the server serves on. The deadline (request_timeout_s) is enforced later, by the engine
(llm_engine.py), and the grammar's compile time by structured_output.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Optional

from backend.config import EngineArgs
from backend.engine.errors import InvalidRequestError
from backend.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    max_n: int
    max_logprobs: int
    max_stop_strings: int
    max_stop_string_len: int
    max_stop_token_ids: int
    max_guided_spec_bytes: int
    request_timeout_s: Optional[float]

    @classmethod
    def from_args(cls, args: EngineArgs) -> "RequestLimits":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    @classmethod
    def defaults(cls) -> "RequestLimits":
        """The engine arguments' defaults (for callers without an engine, e.g. the parser's tests)."""
        return cls(**{f.name: EngineArgs.model_fields[f.name].default for f in fields(cls)})

    def check(self, params: SamplingParams) -> None:
        """Raises InvalidRequestError naming the first field over its limit."""
        _at_most("n", params.n, "max_n", self.max_n)
        if params.logprobs is not None:
            _at_most("logprobs", params.logprobs, "max_logprobs", self.max_logprobs)
        if params.prompt_logprobs is not None:
            _at_most("prompt_logprobs", params.prompt_logprobs, "max_logprobs", self.max_logprobs)
        _at_most("stop", len(params.stop), "max_stop_strings", self.max_stop_strings, "has {} strings")
        longest = max((len(s) for s in params.stop), default=0)
        _at_most("stop", longest, "max_stop_string_len", self.max_stop_string_len,
                 "has a string of {} characters")
        _at_most("stop_token_ids", len(params.stop_token_ids), "max_stop_token_ids", self.max_stop_token_ids,
                 "has {} ids")
        for field in params.guided_fields():
            _at_most(field, guided_spec_bytes(getattr(params, field)), "max_guided_spec_bytes",
                     self.max_guided_spec_bytes, "is {} bytes")
        if params.request_timeout_s is not None and self.request_timeout_s is not None \
                and params.request_timeout_s > self.request_timeout_s:
            raise InvalidRequestError(
                f"sampling parameter 'request_timeout_s' is {params.request_timeout_s:g}, more than the engine "
                f"argument request_timeout_s={self.request_timeout_s:g}: a request may shorten the engine's "
                "deadline, not extend it")

    def deadline(self, params: SamplingParams) -> Optional[tuple[float, str]]:
        """(seconds from arrival, where that came from), or None: no deadline."""
        if params.request_timeout_s is not None:
            return params.request_timeout_s, "sampling parameter"
        if self.request_timeout_s is not None:
            return self.request_timeout_s, "engine argument"
        return None


def guided_spec_bytes(value) -> int:
    """A structured-output spec's size: UTF-8 bytes of its text, or of its compact JSON
    (guided_json given as an object, guided_choice's list). guided_json_object: 0."""
    if isinstance(value, bool):
        return 0
    if not isinstance(value, str):
        value = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return len(value.encode("utf-8", "surrogatepass"))


def _at_most(field: str, value: int, limit_name: str, limit: int, what: str = "is {}") -> None:
    if value > limit:
        raise InvalidRequestError(f"sampling parameter '{field}' {what.format(value)}, more than "
                                  f"{limit_name}={limit} (an engine argument)")
