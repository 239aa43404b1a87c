"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP
status the official client maps to its exception classes."""

from __future__ import annotations

import re
from typing import Optional

from fastapi.responses import JSONResponse

TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError", 413: "RequestTooLargeError",
         429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError", 504: "TimeoutError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=error_body(self.status, self.message, self.param))


def error_body(status: int, message: str, param: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "APIError"), "param": param, "code": status}}


# The engine's messages name the field: "sampling parameter 'x'", "input 'y'".
_PARAM = re.compile(r"(?:sampling parameter|parameter|field|invalid) '([\w.]+)'")


# Triton's python backend names a stub process it has lost (hung past its health check,
# or dead) as "Stub process ..." ("Failed to process the request(s) ..." alone is how it
# reports any exception in execute(): not a sign of a lost stub).
_BACKEND_DOWN = "stub process"


def from_triton(message: str) -> APIError:
    """A Triton error -> the OpenAI status. gRPC streaming delivers only the message; the
    backend spells out the codes a client must act on (backend/triton_server/errors.py):
    UNAVAILABLE (queue full, model out of service) 503; everything else it refuses is a
    bad request, 400, naming the field when the message does."""
    if "unknown model" in message.lower() or "is not found" in message:
        return APIError(404, message, "model")
    if "DEADLINE_EXCEEDED" in message:          # the engine's request_timeout_s: it aborted the request
        return APIError(504, message, "request_timeout_s")
    if message.startswith("UNAVAILABLE") or "UNAVAILABLE:" in message:
        return APIError(503, message)
    if _BACKEND_DOWN in message.lower():
        # Triton's own words when a model's stub process is hung or gone: not the request's
        # fault, and retryable once the supervisor has recovered it (it was a 400).
        return APIError(503, f"the model's backend process is not healthy (being recovered); retry: {message}")
    if message.startswith(("INTERNAL", "CANCELLED")):
        return APIError(500, message)
    m = _PARAM.search(message)
    return APIError(400, message, m.group(1) if m else None)
