"""Triton python-backend adapter (decoupled): Triton tensors in, engine requests, Triton
responses out.

Installed as a Python-based backend: this folder is the backend directory's
`paged_llm/`, and a model's config.pbtxt says `backend: "paged_llm"`. Threads:
 - Triton calls execute(); it parses each request and hands it to the engine loop.
 - The engine loop thread steps the engine and puts outputs on the response queue.
 - The response thread turns outputs into Triton responses, sends them, and polls
   for client cancellation (only this thread touches a request after execute()).
 - The watcher thread (watcher.py) notices server shutdown, checks the engine's health
   and pushes metrics to Triton.
 - Under the supervisor, the heartbeat thread rewrites the health report (health_report.py).
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.config import ConfigError
from backend.engine.engine_loop import EngineLoop, RequestCancelled, RequestStopped
from backend.engine.errors import EngineDeadError, InvalidRequestError
from backend.engine.llm_engine import LLMEngine
from backend.engine.outputs import RequestOutput
from backend.engine.parallel_sampling import child_requests
from backend.engine.prompt_length import tokenize_within
from backend.triton_server.errors import triton_error
from backend.triton_server.health_report import HealthReporter
from backend.triton_server.metrics import EngineMetrics
from backend.triton_server.request_parser import EMBEDDING_SPEC, INPUT_SPECS, OUTPUT_SPECS, parse_request
from backend.triton_server.response_writer import FINAL, ResponseWriter
from backend.triton_server import engine_control, trtllm_front
from backend.triton_server.stop_key import may_stop, required_stop_key
from backend.triton_server.model_entry import read_entry
from backend.triton_server.watcher import Watcher, log_local

_TICK = object()


class TritonPythonModel(Watcher):
    # Set when this model is a TensorRT-LLM-contract front of another model (config
    # parameter `trtllm_contract`): it then only forwards to that model.
    _front: Optional[trtllm_front.TrtLlmFront] = None

    @classmethod
    def auto_complete_config(cls, config):
        contract = trtllm_front.contract_of(config.as_dict())
        if contract:
            return trtllm_front.auto_complete_config(config, contract)
        have_in = {i["name"] for i in config.as_dict().get("input", [])}
        have_out = {o["name"] for o in config.as_dict().get("output", [])}
        for spec in INPUT_SPECS:
            if spec["name"] not in have_in:
                config.add_input(spec)
        params = config.as_dict().get("parameters") or {}
        pooling = (params.get("runner") or {}).get("string_value") == "pooling"
        for spec in OUTPUT_SPECS + ([EMBEDDING_SPEC] if pooling else []):
            if spec["name"] not in have_out:
                config.add_output(spec)
        # The engine batches on its own; Triton must hand requests over one by one and
        # let each stream any number of responses.
        config.set_model_transaction_policy(dict(decoupled=True))
        config.set_max_batch_size(0)
        return config

    def initialize(self, args: dict[str, Any]) -> None:
        self.logger = pb_utils.Logger
        model_config = json.loads(args["model_config"])
        contract = trtllm_front.contract_of(model_config)
        if contract:
            self._front = trtllm_front.TrtLlmFront(args, contract)
            # Its stub can die too (a native crash): the supervisor must see that.
            self._start_heartbeat(args, trtllm_front.STALE_AFTER_S, calls=self._front.llm_model)
            return
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise ConfigError("this backend needs model_transaction_policy { decoupled: true }")
        model_dir = args["model_repository"]
        # A vLLM-backend repository keeps its engine arguments in <version>/model.json.
        engine_args, self.settings, warnings = read_entry(model_dir, args.get("model_version", "1"), model_config)
        for warning in warnings:
            pb_utils.Logger.log_warn(f"[paged_llm] {warning}")
        from backend.build_manifest import check_manifest
        check_manifest(model_dir, engine_args)

        self.model_name = args["model_name"]
        self.engine = LLMEngine(engine_args)
        self.loop = EngineLoop(self.engine)
        self.metrics = self._metrics(args) if self.settings.report_metrics else None
        self.loop.start()

        self._ids = itertools.count()
        self._inflight: dict[str, tuple[Any, ResponseWriter]] = {}
        self._inflight_lock = threading.Lock()
        self._responses: "queue.Queue[Optional[tuple[ResponseWriter, int, RequestOutput]]]" = queue.Queue()
        self._stopping = threading.Event()
        self._unhealthy = False
        self._seen_ready = False
        self._readiness_failures = 0
        self._draining = False
        # Runtime LoRA changes and sleep mode (engine_control.py) wait on the engine: one at a time, here,
        # never on Triton's execute thread.
        self._control_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-control")
        self._admin_key = engine_control.server_admin_key()
        self._start_heartbeat(args, self.settings.engine_stall_timeout_s)    # (before the watcher reports to it)
        self._response_thread = threading.Thread(target=self._response_loop, name="responses", daemon=True)
        self._watch_thread = threading.Thread(target=self._watch_loop, name="watcher", daemon=True)
        self._response_thread.start()
        self._watch_thread.start()
        s = self.engine.stats()
        self.logger.log_info(
            f"[paged_llm] loaded {engine_args.model} on {self.engine.device} ({self.engine.dtype}); "
            f"KV cache {s['num_total_blocks']} blocks x {s['block_size']} tokens, max_model_len {s['max_model_len']}")

    def _metrics(self, args: dict[str, Any]) -> Optional[EngineMetrics]:
        try:
            return EngineMetrics(args["model_name"], args.get("model_version", "1"), self.engine)
        except pb_utils.TritonModelException as e:
            if "metrics not supported" not in str(e):
                raise
            # Servers that refuse custom metrics (the vLLM backend's "metrics refused" case)
            # say so here; 24.10 with --allow-metrics=false accepts them silently.
            self.logger.log_info("[paged_llm] metrics not supported by the server; not reporting them")
            return None

    # ----------------------------------------------------------------- serve
    def execute(self, requests):
        if self._front:
            return self._front.execute(requests)
        self._seen_ready = True  # Triton only hands requests to a ready model
        for request in requests:
            try:
                self._submit(request)
            except Exception as e:  # never let one request take down the batch
                self._reject(request, e)
        return None

    def _submit(self, request) -> None:
        arrival = time.monotonic()
        sender = request.get_response_sender()
        inputs = {}
        for spec in INPUT_SPECS:
            tensor = pb_utils.get_input_tensor_by_name(request, spec["name"])
            if tensor is not None:
                inputs[spec["name"]] = tensor.as_numpy()
        try:
            control = engine_control.control_of(request.parameters())
        except InvalidRequestError as e:
            sender.send(pb_utils.InferenceResponse(error=triton_error(e)), flags=FINAL)
            return
        if control is not None:
            now = engine_control.answer_now(self.loop, control)
            if now is not None:             # read-only: answered here, at once
                sender.send(self._control_response(now), flags=FINAL)
                return
            try:                            # a change: refused here without the key, never queued
                engine_control.check_admin_key(control, self._admin_key)
            except InvalidRequestError as e:
                sender.send(pb_utils.InferenceResponse(error=triton_error(e)), flags=FINAL)
                return
            self._control_pool.submit(self._control, control, sender)
            return
        if "stop" in inputs and bool(inputs["stop"].reshape(-1)[0]):
            try:
                self._stop(request.request_id(), required_stop_key(request.parameters()), sender)
            except InvalidRequestError as e:    # the client's mistake: no traceback in the log
                sender.send(pb_utils.InferenceResponse(error=triton_error(e)), flags=FINAL)
            return
        if self._unhealthy:
            sender.send(pb_utils.InferenceResponse(error=triton_error(EngineDeadError(
                "the engine is unhealthy and the model is being reloaded; retry"))), flags=FINAL)
            return
        tokenize = (lambda t: self.engine.tokenize(t)) if self.engine.tokenizer is not None else None
        try:
            parsed = parse_request(inputs, tokenize, request.parameters(), self.engine.limits,
                                   self.engine.max_model_len)
            if isinstance(parsed.prompt, str) and tokenize is not None:
                # Here, not on the engine thread (every running stream would wait for it),
                # and refused early when it is too long (prompt_length.py).
                parsed.prompt = tokenize_within(tokenize, parsed.prompt, self.engine.max_model_len)
        except InvalidRequestError as e:
            if self.metrics:
                self.metrics.on_rejected("invalid_request")
            sender.send(pb_utils.InferenceResponse(error=triton_error(e)), flags=FINAL)
            return
        request_id = f"{request.request_id() or 'req'}#{next(self._ids)}"
        children = child_requests(request_id, parsed.params)
        writer = ResponseWriter(request_id, sender, parsed, arrival, [cid for cid, _ in children],
                                request.requested_output_names())
        with self._inflight_lock:
            self._inflight[request_id] = (request, writer)
        if self.metrics:
            self.metrics.on_request(parsed.params.n)
        for index, (child_id, params) in enumerate(children):
            self.loop.add_request(parsed.engine_prompt(), params, child_id,
                                  callback=lambda out, w=writer, i=index: self._responses.put((w, i, out)))

    def _control(self, params: dict, sender) -> None:
        """A runtime LoRA change, sleep mode or a listing (engine_control.py): one response, its JSON in
        `text_output`."""
        try:
            response = self._control_response(engine_control.run(self.loop, params, self._admin_key))
        except Exception as e:      # the caller's mistake or a refusal, named
            response = pb_utils.InferenceResponse(error=triton_error(e))
        sender.send(response, flags=FINAL)

    @staticmethod
    def _control_response(result: dict):
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
            "text_output", np.array([json.dumps(result).encode()], dtype=np.object_))])

    def _stop(self, triton_request_id: str, stop_key: str, sender) -> None:
        """End every in-flight request sent with this request id, or with "<id>/..." (how the
        TensorRT-LLM fronts name their rows), and with this `stop_key` (stop_key.py), as
        TensorRT-LLM's `stop` does: each sends what it has as its final response, not an
        error. (An error after streamed responses never reaches a BLS caller in Python
        backend 24.10: the TensorRT-LLM fronts stop their rows this way.)"""
        if not triton_request_id:
            raise InvalidRequestError("input 'stop' needs the request_id of the request to stop")
        target = triton_request_id
        with self._inflight_lock:
            # Our ids are "<Triton request id>#<counter>".
            sent_as = [(w, w.request_id.rsplit("#", 1)[0]) for _, w in self._inflight.values()]
        writers = [w for w, base in sent_as
                   if (base == target or base.startswith(target + "/")) and may_stop(w.parsed.stop_key, stop_key)]
        for writer in writers:
            for child_id in writer.unfinished_child_ids:
                self.loop.abort(child_id, RequestStopped(f"request '{target}' was stopped"))
        sender.send(flags=FINAL)

    def _reject(self, request, exc: Exception) -> None:
        self.logger.log_error(f"[paged_llm] request failed: {traceback.format_exc()}")
        try:
            request.get_response_sender().send(pb_utils.InferenceResponse(error=triton_error(exc)), flags=FINAL)
        except Exception:
            pass

    def _response_loop(self) -> None:
        """The only thread that touches Triton request objects after execute(): it sends
        responses and polls cancellation. Asking a request whose FINAL response was sent
        whether it is cancelled crashes the server, so both must happen here, in order."""
        interval = self.settings.cancel_poll_interval_s
        next_poll = time.monotonic() + interval
        while True:
            try:
                item = self._responses.get(timeout=max(next_poll - time.monotonic(), 0.0))
            except queue.Empty:
                item = _TICK
            if item is None:
                return
            if item is not _TICK:
                self._send_output(*item)
            if time.monotonic() >= next_poll:
                self._poll_cancellations()
                next_poll = time.monotonic() + interval

    def _send_output(self, writer: ResponseWriter, index: int, out: RequestOutput) -> None:
        try:
            reply = writer.on_output(index, out)
            if out.finished and self.metrics and (out.error is None or reply is not None):  # an error counts once
                self.metrics.on_sequence_finished(writer.seqs[index].timing, out.error, time.monotonic())
            if reply is not None:
                response, flags = reply
                if flags & FINAL and self.metrics and not self._draining:
                    # Counts are visible by the time the client has its answer. Not while
                    # the server stops: a metric call then can block for good.
                    self.metrics.flush()
                writer.send(response, flags)
        except Exception:
            log_local(f"[paged_llm] could not send to {writer.request_id}; aborting it")
            writer.done = True
        if writer.done:
            # An error, a client gone or the last sequence: no sibling may run on.
            for child_id in writer.unfinished_child_ids:
                self.loop.abort(child_id)
            with self._inflight_lock:
                self._inflight.pop(writer.request_id, None)

    def _poll_cancellations(self) -> None:
        with self._inflight_lock:
            items = list(self._inflight.items())
        for request_id, (request, writer) in items:
            if writer.done or writer.cancel_sent:
                continue
            try:
                cancelled = request.is_cancelled()
            except Exception:
                cancelled = True
            if cancelled:
                writer.cancel_sent = True
                for child_id in writer.unfinished_child_ids:
                    self.loop.abort(child_id, RequestCancelled(f"request '{request_id}' was cancelled by the client"))

    def _start_heartbeat(self, args: dict[str, Any], stale_after_s: float, calls: str = "") -> None:
        """Under the supervisor (health_report.py): this instance's report, rewritten by a
        thread of its own until finalize has written the last one."""
        self.health = HealthReporter.from_env(args["model_instance_name"], args["model_name"], stale_after_s,
                                              calls)
        self._beating = threading.Event()   # set once the final report is written (finalize)
        if self.health:
            self.health.heartbeat()
            threading.Thread(target=self.health.beat_until, args=(self._beating,), name="heartbeat",
                             daemon=True).start()

    def _stop_heartbeat(self) -> None:
        if self.health:
            self.health.stopped()
        self._beating.set()

    def finalize(self) -> None:
        if self._front:
            self._stop_heartbeat()  # nothing else of its own: every row ended with its request
            return
        if self._unhealthy:
            # In-flight requests already got their error; a stalled loop thread would
            # only hold the unload up (it is a daemon and dies with the process).
            self.loop.stop(0.0, join_timeout_s=1.0)
        elif not self._draining:
            self._draining = True
            self._drain()
        self._stopping.set()
        self._control_pool.shutdown(wait=False)
        self._responses.put(None)
        self._response_thread.join(timeout=10)
        self._watch_thread.join(timeout=5)
        self.engine.shutdown()  # tensor-parallel ranks: unloading stops every one
        if self._unhealthy and self.metrics:
            self.metrics.close()  # the supervisor loads the model again: start its metrics clean
        self._stop_heartbeat()
