"""Engine errors -> Triton errors, with codes a client can act on."""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from backend.engine.engine_loop import RequestCancelled
from backend.engine.errors import (DeadlineExceededError, EngineBusyError, EngineDeadError, EngineSleepingError,
                                   InvalidRequestError, QueueFullError)


def triton_error(exc: BaseException) -> "pb_utils.TritonError":
    """gRPC streaming delivers only an error's message, not its code, so codes a client
    should act on (retry later, was cancelled) are also spelled out in the message."""
    E = pb_utils.TritonError
    if isinstance(exc, InvalidRequestError):
        return E(str(exc), E.INVALID_ARG)
    if isinstance(exc, (QueueFullError, EngineDeadError, EngineSleepingError, EngineBusyError)):
        return E(f"UNAVAILABLE: {exc}", E.UNAVAILABLE)
    if isinstance(exc, DeadlineExceededError):   # the server ended it; Triton has no DEADLINE_EXCEEDED code
        return E(f"DEADLINE_EXCEEDED: {exc}", E.CANCELLED)
    if isinstance(exc, RequestCancelled):
        return E(f"CANCELLED: {exc}", E.CANCELLED)
    return E(f"INTERNAL: {exc!r}", E.INTERNAL)
