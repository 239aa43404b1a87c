"""Drives an LLMEngine from its own thread and streams each request's deltas.

Callers on any thread submit and abort through an inbox; only the loop thread touches
the engine, so the engine needs no locks. Each request's outputs go to a callback (the
Triton adapter's response sender) or to a RequestStream iterator. Every request gets
exactly one final output: normal finish, abort, error, or shutdown.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

from backend.engine.errors import EngineDeadError
from backend.engine.llm_engine import LLMEngine, Prompt
from backend.engine.outputs import RequestOutput
from backend.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]


class RequestCancelled(RuntimeError):
    """The request was aborted by its caller."""


class RequestStopped(RequestCancelled):
    """The request was ended on purpose (TensorRT-LLM's `stop`): its caller gets what was
    generated so far as a normal final output, finish_reason "abort", not an error."""


@dataclass
class _Add:
    prompt: Prompt
    params: SamplingParams
    request_id: str
    callback: OutputCallback
    arrival_time: float


@dataclass
class _Abort:
    request_id: str
    reason: Optional[Exception]


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


class EngineLoop:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._inbox: "queue.Queue[Union[_Add, _Abort]]" = queue.Queue()
        self._callbacks: dict[str, OutputCallback] = {}
        self._idle_wait_s = idle_wait_s
        self._stop = threading.Event()
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.error: Optional[BaseException] = None
        self.last_heartbeat = time.monotonic()

    # -------------------------------------------------------------- public
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str,
                    callback: Optional[OutputCallback] = None) -> Optional[RequestStream]:
        """Queue a request. Without a callback, returns a RequestStream to iterate."""
        stream = None
        if callback is None:
            stream = callback = RequestStream()
        if not self._accepting or self.error is not None:
            callback(error_output(request_id, EngineDeadError(
                "the engine is shutting down" if self.error is None else f"the engine failed: {self.error}")))
            return stream
        self._inbox.put(_Add(prompt, params, request_id, callback, time.monotonic()))
        return stream

    def abort(self, request_id: str, reason: Optional[Exception] = None) -> None:
        """Abort a request; its blocks are freed at the start of the next loop iteration."""
        self._inbox.put(_Abort(request_id, reason))

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._callbacks) + self._inbox.qsize()

    def stop(self, grace_period_s: float = 0.0, join_timeout_s: float = 30.0) -> None:
        """Refuse new requests, let in-flight ones finish for up to grace_period_s, then
        fail the rest with an error and end the thread."""
        self._accepting = False
        deadline = time.monotonic() + grace_period_s
        while self.num_in_flight and time.monotonic() < deadline and self.is_alive:
            time.sleep(0.01)
        self._stop.set()
        self._thread.join(timeout=join_timeout_s)

    # ---------------------------------------------------------------- loop
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox(block=not self.engine.has_unfinished_requests())
                self.engine.check_health()      # a dead tensor-parallel rank fails the loop, idle or not
                self.last_heartbeat = time.monotonic()
                if not self.engine.has_unfinished_requests():
                    continue
                outputs = self.engine.step()
                self._deliver(outputs)
        except BaseException as e:  # the loop must never die silently
            logger.exception("engine loop failed")
            self.error = e
            self._fail_all(EngineDeadError(f"the engine failed: {e!r}"))
            return
        self._fail_all(EngineDeadError("the server is shutting down; the request was cancelled"))

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self._idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: Union[_Add, _Abort]) -> None:
        if isinstance(item, _Abort):
            out = self.engine.abort_request(item.request_id)
            callback = self._callbacks.pop(item.request_id, None)
            if out is not None and callback is not None:
                out.error = item.reason or RequestCancelled(f"request '{item.request_id}' was cancelled")
                self._safe_call(callback, out)
            return
        try:
            self.engine.add_request(item.prompt, item.params, item.request_id, item.arrival_time)
        except Exception as e:  # a bad request fails alone
            self._safe_call(item.callback, error_output(item.request_id, e))
            return
        self._callbacks[item.request_id] = item.callback

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            callback = self._callbacks.get(out.request_id)
            if callback is None:
                continue
            if out.finished:
                del self._callbacks[out.request_id]
            self._safe_call(callback, out)

    def _safe_call(self, callback: OutputCallback, out: RequestOutput) -> None:
        try:
            callback(out)
        except Exception:
            # A consumer that cannot take output (client gone) must not stop the others.
            logger.exception("output callback failed for %s; aborting it", out.request_id)
            if not out.finished:
                self.engine.abort_request(out.request_id)
                self._callbacks.pop(out.request_id, None)

    def _fail_all(self, error: Exception) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Add):
                self._safe_call(item.callback, error_output(item.request_id, error))
        for request_id, callback in list(self._callbacks.items()):
            try:
                out = self.engine.abort_request(request_id)
            except Exception:
                out = None
            out = out or error_output(request_id, error)
            out.error = error
            self._safe_call(callback, out)
        self._callbacks.clear()


def error_output(request_id: str, error: Exception) -> RequestOutput:
    return RequestOutput(request_id=request_id, new_token_ids=[], new_text="", finished=True,
                         finish_reason="error", error=error)
