"""What goes between an EngineLoop's callers, its engine thread and its output thread
(engine_loop.py): the inbox's items, the output thread's queue items, a request's
blocking stream, and the errors a caller can tell apart."""

from __future__ import annotations

import queue
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from backend.engine.intake import PreparedPrompt
from backend.engine.outputs import RequestOutput
from backend.sampling_params import SamplingParams

OutputCallback = Callable[[RequestOutput], None]


class RequestCancelled(RuntimeError):
    """The request was aborted by its caller."""


class RequestStopped(RequestCancelled):
    """The request was ended on purpose (TensorRT-LLM's `stop`): its caller gets what was
    generated so far as a normal final output, finish_reason "abort", not an error."""


@dataclass
class _Add:
    prompt: PreparedPrompt
    params: SamplingParams
    request_id: str
    callback: OutputCallback
    arrival_time: float


@dataclass
class _Abort:
    request_id: str
    reason: Optional[Exception]


@dataclass
class _Stop:
    """A stop string ended the request (found by the output thread)."""
    request_id: str


@dataclass
class _Call:
    """A change to the engine made on its thread between steps (a runtime adapter, sleep
    mode); `future` gets its result or its error."""
    fn: Callable[[], object]
    future: Future


@dataclass
class _Added:
    """To the output thread, before any output of the request: where its outputs go."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    callback: OutputCallback


@dataclass
class _Closed:
    """To the output thread, last: the engine thread has ended; fail what is left."""
    error: Exception


class RequestStream:
    """Blocking iterator over one request's outputs, ending after the final one."""

    def __init__(self) -> None:
        self._q: "queue.Queue[RequestOutput]" = queue.Queue()

    def __call__(self, out: RequestOutput) -> None:
        self._q.put(out)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            out = self._q.get()
            yield out
            if out.finished:
                return


def error_output(request_id: str, error: Exception) -> RequestOutput:
    return RequestOutput(request_id=request_id, new_token_ids=[], new_text="", finished=True,
                         finish_reason="error", error=error)
