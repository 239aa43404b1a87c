"""Errors a caller can act on, one class per cause."""


class InvalidRequestError(ValueError):
    """The request itself is wrong (bad prompt, bad parameters); other requests are unaffected."""


def check_token_ids(token_ids, vocab_size: int, what: str = "") -> None:
    """Every id in [0, vocab_size), else InvalidRequestError naming the first one outside
    (and `what` holds it: "sampling parameter 'logit_bias'", ...). The one vocabulary check
    of the prompt and of every parameter that carries token ids."""
    for t in token_ids:
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(f"{what + ': ' if what else ''}token id {t} is outside the vocabulary "
                                      f"[0, {vocab_size})")


class QueueFullError(RuntimeError):
    """The waiting queue is at max_queue_size: the request is shed, try again later."""


class EngineBusyError(RuntimeError):
    """A change to the engine (sleep, wake_up) is still in progress past the wait for it:
    it goes on; ask again later."""


class EngineSleepingError(RuntimeError):
    """The engine is in sleep mode (sleep_mode.py): retry once it is woken up."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped; requests in flight cannot complete."""


class DeadlineExceededError(RuntimeError):
    """The request was still unfinished at its deadline (request_timeout_s) and was aborted;
    what it streamed before stays delivered."""
