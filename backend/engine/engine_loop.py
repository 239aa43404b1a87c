"""Drives an LLMEngine from its own thread and streams each request's deltas.

Two threads, as vLLM v1 splits its engine core from its output processing:

- the engine thread alone touches the engine (schedule, execute, update: core_step),
  so the engine needs no locks; callers on any thread submit and abort through its
  inbox;
- the output thread alone runs the output side (OutputProcessor: detokenization, stop
  strings, logprob text) and the callbacks, on the engine's EngineCoreOutputs, which
  reach it through its queue in step order. It works while the engine thread waits on
  the device. A stop string it finds goes back to the engine as one inbox item.

Each request's outputs go to a callback (the Triton adapter's response sender) or to a
RequestStream iterator. Every request gets exactly one final output: normal finish,
abort, error, or shutdown.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional, Union

from backend.engine.early_aborts import EarlyAborts
from backend.engine.errors import EngineDeadError, EngineSleepingError
from backend.engine.gc_policy import freeze_heap
from backend.engine.host_malloc import IdleTrim
from backend.engine.llm_engine import LLMEngine, Prompt
# (RequestCancelled, RequestStopped, RequestStream, error_output: importable from here too)
from backend.engine.loop_messages import (OutputCallback, RequestCancelled, RequestStopped,  # noqa: F401
                                          RequestStream, _Abort, _Add, _Added, _Call, _Closed, _Stop, error_output)
from backend.engine.output_processor import OutputProcessor
from backend.engine.outputs import EngineCoreOutput, RequestOutput
from backend.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

class EngineLoop:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._inbox: "queue.Queue[Union[_Add, _Abort, _Stop, _Call]]" = queue.Queue()
        self._early_aborts: EarlyAborts[_Abort] = EarlyAborts()   # engine thread only
        self._outbox: "queue.Queue[Union[_Added, list[EngineCoreOutput], _Closed]]" = queue.Queue()
        # Output thread state: each request's output side and callback.
        self._outputs = OutputProcessor(engine.tokenizer)
        self._callbacks: dict[str, OutputCallback] = {}
        self._num_in_flight = 0
        self._count_lock = threading.Lock()
        self._idle_wait_s = idle_wait_s
        self._idle_trim = IdleTrim()        # free heap back to the system after a quiet spell
        self._stop = threading.Event()
        self._accepting = True
        # Set (under the lock) once the engine thread has drained its inbox for good.
        self._intake_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._output_thread = threading.Thread(target=self._run_outputs, name="engine-outputs", daemon=True)
        self.error: Optional[BaseException] = None
        self.last_heartbeat = time.monotonic()

    # -------------------------------------------------------------- public
    def start(self) -> "EngineLoop":
        freeze_heap()
        self._output_thread.start()
        self._thread.start()
        return self

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str,
                    callback: Optional[OutputCallback] = None) -> Optional[RequestStream]:
        """Queue a request. Without a callback, returns a RequestStream to iterate."""
        stream = None
        if callback is None:
            stream = callback = RequestStream()
        if not self._open():
            return self._refuse(request_id, callback, stream)
        if self.engine.sleep_mode.refuses_requests:      # (not counted in flight: see sleep_mode.py)
            callback(error_output(request_id, EngineSleepingError(
                "the engine is asleep (sleep mode): wake it up (POST /wake_up), then retry")))
            return stream
        arrival_time = time.monotonic()
        # The text work on this (the caller's) thread: the engine thread only checks and schedules.
        prepared = self.engine.prepare(prompt, params)
        with self._intake_lock:         # (never after _close drained the inbox: nothing would read it)
            queued = self._open()
            if queued:
                self._count(+1)
                self._inbox.put(_Add(prepared, params, request_id, callback, arrival_time))
        return stream if queued else self._refuse(request_id, callback, stream)

    def _open(self) -> bool:
        return self._accepting and self.error is None and not self._closed

    def _refuse(self, request_id: str, callback: OutputCallback, stream):
        callback(error_output(request_id, EngineDeadError(
            f"the engine failed: {self.error}" if self.error is not None else "the engine is shutting down")))
        return stream

    def add_lora(self, name: str, path: str) -> Future:
        """Serve the adapter at `path` as `name`. Its files are read and checked here, on
        the caller's thread (errors raise here); the future resolves once the engine
        thread has registered it."""
        adapter = self.engine.runtime_lora.read(name, path)
        return self.call(lambda: self.engine.runtime_lora.add(adapter))

    def remove_lora(self, name: str) -> Future:
        """Refuse new requests for `name` and drop it once its requests finish; the
        future resolves to True when it was dropped at once, False when it waits."""
        return self.call(lambda: self.engine.runtime_lora.remove(name))

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the engine thread between steps (sleep mode, say); the future of
        its result."""
        future: Future = Future()
        with self._intake_lock:
            if self._open():
                self._inbox.put(_Call(fn, future))
                return future
        future.set_exception(EngineDeadError("the engine is shutting down" if self.error is None
                                             else f"the engine failed: {self.error}"))
        return future

    def abort(self, request_id: str, reason: Optional[Exception] = None) -> None:
        """Abort a request; its blocks are freed at the start of the next loop iteration."""
        self._inbox.put(_Abort(request_id, reason))

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        """Requests accepted whose final output has not been delivered."""
        return self._num_in_flight

    def stop(self, grace_period_s: float = 0.0, join_timeout_s: float = 30.0) -> None:
        """Refuse new requests, let in-flight ones finish for up to grace_period_s, then
        fail the rest with an error and end the threads."""
        self._accepting = False
        deadline = time.monotonic() + grace_period_s
        while self.num_in_flight and time.monotonic() < deadline and self.is_alive:
            time.sleep(0.01)
        self._stop.set()
        self._thread.join(timeout=join_timeout_s)
        self._output_thread.join(timeout=join_timeout_s)

    def _count(self, delta: int) -> None:
        with self._count_lock:
            self._num_in_flight += delta

    # --------------------------------------------------------- engine thread
    def _run(self) -> None:
        error: Exception = EngineDeadError("the server is shutting down; the request was cancelled")
        try:
            while not self._stop.is_set():
                self._drain_inbox(block=not self.engine.has_unfinished_requests())
                self.engine.check_health()      # a dead tensor-parallel rank fails the loop, idle or not
                self.last_heartbeat = time.monotonic()
                if self.engine.has_unfinished_requests():
                    self._idle_trim.busy()
                    outputs = self.engine.core_step()
                    if outputs:
                        self._outbox.put(outputs)
                else:
                    self._idle_trim.idle()
                self.engine.after_step()    # (also after an abort or a change, with no step)
        except BaseException as e:  # the loop must never die silently
            logger.exception("engine loop failed")
            self.error = e
            error = EngineDeadError(f"the engine failed: {e!r}")
        self._close(error)

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

    def _handle(self, item: Union[_Add, _Abort, _Stop, _Call]) -> None:
        if isinstance(item, _Call):
            self._call(item)
            return
        if isinstance(item, _Stop):
            self.engine.stop_requests([item.request_id])
            return
        if isinstance(item, _Abort):
            out = self.engine.abort_core(item.request_id)
            if out is not None:
                out.error = item.reason or RequestCancelled(f"request '{item.request_id}' was cancelled")
                self._outbox.put([out])
            else:
                self._early_aborts.hold(item.request_id, item)   # its add may still be on the way
            return
        early = self._early_aborts.take(item.request_id)
        try:
            request = self.engine.add_core_request(item.prompt, item.params, item.request_id, item.arrival_time)
        except Exception as e:  # a bad request fails alone
            self._deliver_final(item.callback, error_output(item.request_id, e))
            return
        self._outbox.put(_Added(item.request_id, request.prompt_token_ids, item.params, item.callback))
        if early is not None:
            self._handle(early)

    def _call(self, item: _Call) -> None:
        try:
            result = item.fn()
        except Exception as e:      # a refused change fails its caller alone
            item.future.set_exception(e)
            return
        item.future.set_result(result)

    def _close(self, error: Exception) -> None:
        """The engine thread's end: requests still queued fail; those in the engine are
        aborted (their blocks freed) and the output thread fails them."""
        with self._intake_lock:
            self._closed = True
            queued = []
            while True:
                try:
                    queued.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
        for item in queued:
            if isinstance(item, _Add):
                self._deliver_final(item.callback, error_output(item.request_id, error))
            elif isinstance(item, _Call):
                item.future.set_exception(error)
        try:
            self.engine.abort_all()
        except Exception:
            logger.exception("could not abort the engine's requests at shutdown")
        self._outbox.put(_Closed(error))

    # --------------------------------------------------------- output thread
    def _run_outputs(self) -> None:
        while True:
            item = self._outbox.get()
            try:
                if isinstance(item, _Closed):
                    self._fail_all(item.error)
                    return
                if isinstance(item, _Added):
                    self._outputs.add(item.request_id, item.prompt_token_ids, item.params)
                    self._callbacks[item.request_id] = item.callback
                    continue
                outputs, stopped = self._outputs.process(item)
                for request_id in stopped:
                    self._inbox.put(_Stop(request_id))
                for out in outputs:
                    self._deliver(out)
            except Exception:       # the output side must never die: the streams would hang
                logger.exception("output processing failed")
            finally:
                self._outbox.task_done()

    def wait_outputs(self) -> None:
        """Blocks until the output thread has delivered everything the engine thread
        handed it so far (a benchmark's end of a timed run)."""
        self._outbox.join()

    def _deliver(self, out: RequestOutput) -> None:
        callback = self._callbacks.get(out.request_id)
        if callback is None:
            return
        if out.finished:
            del self._callbacks[out.request_id]
            self._deliver_final(callback, out)
            return
        try:
            callback(out)
        except Exception:
            # A consumer that cannot take output (client gone) must not stop the others.
            logger.exception("output callback failed for %s; aborting it", out.request_id)
            self._callbacks.pop(out.request_id, None)
            self._outputs.discard(out.request_id)
            self._count(-1)
            self._inbox.put(_Abort(out.request_id, None))

    def _deliver_final(self, callback: OutputCallback, out: RequestOutput) -> None:
        self._count(-1)
        try:
            callback(out)
        except Exception:
            logger.exception("output callback failed for %s", out.request_id)

    def _fail_all(self, error: Exception) -> None:
        for request_id, callback in list(self._callbacks.items()):
            out = self._outputs.final_output(request_id, "abort") if request_id in self._outputs else \
                error_output(request_id, error)
            out.error = error
            self._deliver_final(callback, out)
        self._callbacks.clear()
