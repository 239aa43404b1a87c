"""schemathesis hooks for fuzzing the OpenAI frontend: tests/integration/test_api_fuzz.py
imports them, and `st run` by hand loads them (`SCHEMATHESIS_HOOKS=tests/integration/
fuzz_hooks.py`, docs/security.md).

Every generated body keeps its shape; two things are steered so that a bounded run spends
its requests in the engine rather than in 404s and long generations:
- `model`: most cases name a served model (`llm` or one of its LoRA adapters), the
  others keep the generated value (an unknown model: 404);
- the number of tokens: `max_tokens`/`max_completion_tokens`/`max_output_tokens` at most MAX_TOKENS, set
  when the body leaves the length open (chat's default is the whole context), and
  `min_tokens` at most MAX_TOKENS too (above `max_tokens` it is still a 400);
- `request_timeout_s`: a positive deadline at least MIN_DEADLINE_S.
Values of the wrong type are left as generated: they are the negative cases.
"""

from __future__ import annotations

from typing import Any, Optional

import schemathesis
from hypothesis import strategies as st

MAX_TOKENS = 4
MIN_DEADLINE_S = 60.0
MODELS = ("llm", "llm", "llm", "sql", "chat", None)     # None: the generated value


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def bounded(body: Any, model: Optional[str], responses: bool = False) -> Any:
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if model is not None:
        body["model"] = model
    lengths = ("max_tokens", "max_completion_tokens", "max_output_tokens")
    for key in lengths + ("min_tokens",):
        if _int(body.get(key)) and body[key] > MAX_TOKENS:
            body[key] = MAX_TOKENS
    if all(body.get(key) is None for key in lengths):
        body["max_output_tokens" if responses else "max_tokens"] = MAX_TOKENS
    # A deadline the request could pass is a 504 by design (test_security.py checks it):
    # positive deadlines get room; zero, negative and wrong types stay the negative cases.
    timeout = body.get("request_timeout_s")
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < timeout < MIN_DEADLINE_S:
        body["request_timeout_s"] = MIN_DEADLINE_S
    return body


@schemathesis.hook
def flatmap_body(context, body):
    if context.operation is None or context.operation.method.lower() != "post" or not (
            context.operation.path.endswith("completions") or context.operation.path == "/v1/responses"):
        return st.just(body)
    responses = context.operation.path == "/v1/responses"
    return st.sampled_from(MODELS).map(lambda model: bounded(body, model, responses))
