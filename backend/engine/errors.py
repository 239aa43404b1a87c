"""Errors a caller can act on, one class per cause."""


class InvalidRequestError(ValueError):
    """The request itself is wrong (bad prompt, bad parameters); other requests are unaffected."""


class QueueFullError(RuntimeError):
    """The waiting queue is at max_queue_size: the request is shed, try again later."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped; requests in flight cannot complete."""


class DeadlineExceededError(RuntimeError):
    """The request was still unfinished at its deadline (request_timeout_s) and was aborted;
    what it streamed before stays delivered."""
