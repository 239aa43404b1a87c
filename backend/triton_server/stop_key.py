"""Who may end a request by its id: TensorRT-LLM's `stop` input, bound to a key.

TensorRT-LLM ends a running request when a second request arrives with `stop` true and
the same request id, from anyone. Request ids are chosen by clients and often guessable
("1", "req-42"), and inference is open to every client, so anyone could end anyone's
request. Here a `stop` ends only the requests sent with the same `stop_key`: a request
parameter (tritonclient's `parameters={"stop_key": ...}`, a `/generate` body field, or
gRPC's `parameters` map) that the client chooses and keeps to itself.

A request sent without a `stop_key` cannot be stopped by id at all: only by cancelling
its own stream or connection, which no other client holds. A `stop` whose key matches
nothing ends nothing and is answered like one for an id that has already finished, so it
tells a guesser nothing.
"""

from __future__ import annotations

import hmac
import json
from typing import Optional

from backend.engine.errors import InvalidRequestError

STOP_KEY = "stop_key"
MAX_STOP_KEY_CHARS = 256


def stop_key_of(request_parameters: str) -> Optional[str]:
    """The request's `stop_key` parameter, if it sent one (Triton's `request.parameters()`
    JSON). Malformed JSON is left to the sampling-parameter parser, which names it."""
    try:
        params = json.loads(request_parameters) if request_parameters and request_parameters.strip() else {}
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(params, dict) or STOP_KEY not in params:
        return None
    key = params[STOP_KEY]
    if not isinstance(key, str) or not key:
        raise InvalidRequestError(f"request parameter '{STOP_KEY}' must be a non-empty string")
    if len(key) > MAX_STOP_KEY_CHARS:
        raise InvalidRequestError(f"request parameter '{STOP_KEY}' has {len(key)} characters, "
                                  f"more than {MAX_STOP_KEY_CHARS}")
    return key


def required_stop_key(request_parameters: str) -> str:
    """The key a `stop` request must carry."""
    key = stop_key_of(request_parameters)
    if key is None:
        raise InvalidRequestError(
            f"input 'stop' needs the request parameter '{STOP_KEY}' that the request to stop was sent with "
            "(a request sent without one can be ended only by cancelling its own stream)")
    return key


def may_stop(sent_with: Optional[str], stop_key: str) -> bool:
    """Whether a `stop` carrying `stop_key` may end a request sent with `sent_with`
    (compared in constant time: a mismatch's timing says nothing of the key)."""
    return sent_with is not None and hmac.compare_digest(sent_with.encode(), stop_key.encode())
