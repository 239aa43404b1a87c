"""Triton python-backend adapter (decoupled): Triton tensors in, engine requests, Triton
responses out.

Installed as a Python-based backend: this folder is the backend directory's
`paged_llm/`, and a model's config.pbtxt says `backend: "paged_llm"`. Threads:
 - Triton calls execute(); it parses each request and hands it to the engine loop.
 - The engine loop thread steps the engine and puts outputs on the response queue.
 - The response thread turns outputs into Triton responses and sends them.
 - The watcher thread aborts requests whose client cancelled or went away, and keeps
   the health state and the gauges current.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
import traceback
from typing import Any, Optional

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.config import ConfigError
from backend.engine.engine_loop import EngineLoop, RequestCancelled
from backend.engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from backend.engine.llm_engine import LLMEngine
from backend.engine.outputs import RequestOutput
from backend.triton_server.metrics import EngineMetrics
from backend.triton_server.request_parser import INPUT_SPECS, OUTPUT_SPECS, ParsedRequest, parse_request
from backend.triton_server.serving_config import load_settings, parameters_from_model_config

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def triton_error(exc: BaseException) -> "pb_utils.TritonError":
    E = pb_utils.TritonError
    if isinstance(exc, InvalidRequestError):
        return E(str(exc), E.INVALID_ARG)
    if isinstance(exc, QueueFullError):
        return E(str(exc), E.UNAVAILABLE)
    if isinstance(exc, RequestCancelled):
        return E(str(exc), E.CANCELLED)
    if isinstance(exc, EngineDeadError):
        return E(str(exc), E.UNAVAILABLE)
    return E(f"internal error: {exc!r}", E.INTERNAL)


class ResponseWriter:
    """Turns one request's engine outputs into Triton responses (on the response thread)."""

    def __init__(self, request_id: str, sender, parsed: ParsedRequest, arrival: float) -> None:
        self.request_id = request_id
        self.sender = sender
        self.parsed = parsed
        self.arrival = arrival
        self.sent_prompt = False
        self.text_parts: list[str] = []
        self.first_token_time: Optional[float] = None
        self.done = False

    def handle(self, out: RequestOutput) -> None:
        if self.done:
            return
        if out.error is not None:
            self._send(pb_utils.InferenceResponse(error=triton_error(out.error)), FINAL)
            return
        if out.new_token_ids and self.first_token_time is None:
            self.first_token_time = time.monotonic()
        p = self.parsed
        if p.stream:
            text = out.new_text
            if not p.exclude_input_in_output and not self.sent_prompt:
                text, self.sent_prompt = p.prompt_text + text, True
            self._send(self._response(text, out, len(out.new_token_ids), out.new_token_ids),
                       FINAL if out.finished else 0)
            return
        self.text_parts.append(out.new_text)
        if out.finished:
            text = "".join(self.text_parts)
            if not p.exclude_input_in_output:
                text = p.prompt_text + text
            self._send(self._response(text, out, out.num_output_tokens, out.token_ids), FINAL)

    def _response(self, text: str, out: RequestOutput, n_tokens: int, token_ids: list[int]):
        p = self.parsed
        tensors = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
                   pb_utils.Tensor("output_ids", np.array(token_ids, dtype=np.int32))]
        if p.return_finish_reason:
            reason = out.finish_reason if out.finished else ""
            tensors.append(pb_utils.Tensor("finish_reason", np.array([str(reason).encode()], dtype=np.object_)))
        if p.return_num_input_tokens:
            tensors.append(pb_utils.Tensor("num_input_tokens", np.array([out.num_prompt_tokens], dtype=np.uint32)))
        if p.return_num_output_tokens:
            tensors.append(pb_utils.Tensor("num_output_tokens", np.array([n_tokens], dtype=np.uint32)))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _send(self, response, flags: int) -> None:
        if flags & FINAL:
            self.done = True
        try:
            self.sender.send(response, flags=flags)
        except Exception:
            # The client is gone; the watcher aborts the request on its next pass.
            if not self.done:
                raise


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, config):
        have_in = {i["name"] for i in config.as_dict().get("input", [])}
        have_out = {o["name"] for o in config.as_dict().get("output", [])}
        for spec in INPUT_SPECS:
            if spec["name"] not in have_in:
                config.add_input(spec)
        for spec in OUTPUT_SPECS:
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
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise ConfigError("this backend needs model_transaction_policy { decoupled: true }")
        model_dir = args["model_repository"]
        engine_args, self.settings = load_settings(parameters_from_model_config(model_config), model_dir)
        from backend.build_manifest import check_manifest
        check_manifest(model_dir, engine_args)

        self.engine = LLMEngine(engine_args)
        self.loop = EngineLoop(self.engine)
        self.metrics = EngineMetrics(args["model_name"], self.engine) if self.settings.report_metrics else None
        if self.metrics:
            self.loop.step_listeners.append(self.metrics.on_step)
        self.loop.start()

        self._ids = itertools.count()
        self._inflight: dict[str, tuple[Any, ResponseWriter]] = {}
        self._inflight_lock = threading.Lock()
        self._responses: "queue.Queue[Optional[tuple[ResponseWriter, RequestOutput]]]" = queue.Queue()
        self._stopping = threading.Event()
        self._response_thread = threading.Thread(target=self._response_loop, name="responses", daemon=True)
        self._watch_thread = threading.Thread(target=self._watch_loop, name="watcher", daemon=True)
        self._response_thread.start()
        self._watch_thread.start()
        s = self.engine.kv_cache_stats()
        self.logger.log_info(
            f"[paged_llm] loaded {engine_args.model} on {self.engine.device} ({self.engine.dtype}); "
            f"KV cache {s['num_total_blocks']} blocks x {s['block_size']} tokens, max_model_len {s['max_model_len']}")

    # ----------------------------------------------------------------- serve
    def execute(self, requests):
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
        tokenize = (lambda t: self.engine.tokenize(t)) if self.engine.tokenizer is not None else None
        try:
            parsed = parse_request(inputs, tokenize)
        except InvalidRequestError as e:
            if self.metrics:
                self.metrics.on_rejected("invalid_request")
            sender.send(pb_utils.InferenceResponse(error=triton_error(e)), flags=FINAL)
            return
        request_id = f"{request.request_id() or 'req'}#{next(self._ids)}"
        writer = ResponseWriter(request_id, sender, parsed, arrival)
        with self._inflight_lock:
            self._inflight[request_id] = (request, writer)
        self.loop.add_request(parsed.prompt, parsed.params, request_id,
                              callback=lambda out, w=writer: self._responses.put((w, out)))

    def _reject(self, request, exc: Exception) -> None:
        self.logger.log_error(f"[paged_llm] request failed: {traceback.format_exc()}")
        try:
            request.get_response_sender().send(pb_utils.InferenceResponse(error=triton_error(exc)), flags=FINAL)
        except Exception:
            pass

    def _response_loop(self) -> None:
        while True:
            item = self._responses.get()
            if item is None:
                return
            writer, out = item
            try:
                writer.handle(out)
            except Exception:
                self.logger.log_warn(f"[paged_llm] could not send to {writer.request_id}; aborting it")
                self.loop.abort(writer.request_id)
            if out.finished:
                with self._inflight_lock:
                    self._inflight.pop(writer.request_id, None)
                if self.metrics:
                    self.metrics.on_finished(out, writer.arrival, writer.first_token_time)

    def _watch_loop(self) -> None:
        while not self._stopping.wait(self.settings.cancel_poll_interval_s):
            with self._inflight_lock:
                items = list(self._inflight.items())
            for request_id, (request, writer) in items:
                if writer.done:
                    continue
                try:
                    cancelled = request.is_cancelled()
                except Exception:
                    cancelled = True
                if cancelled:
                    self.loop.abort(request_id, RequestCancelled(f"request '{request_id}' was cancelled by the client"))
            if self.metrics:
                self.metrics.update_gauges()

    # ---------------------------------------------------------------- health
    def is_healthy(self) -> bool:
        """Deep check: the loop thread is alive and, when it has work, keeps stepping."""
        if not self.loop.is_alive:
            return False
        busy = self.loop.num_in_flight > 0
        return not busy or time.monotonic() - self.loop.last_heartbeat < self.settings.health_timeout_s

    def finalize(self) -> None:
        self.logger.log_info(f"[paged_llm] stopping: {self.loop.num_in_flight} requests in flight, "
                             f"grace period {self.settings.grace_period_s}s")
        self.loop.stop(self.settings.grace_period_s)
        self._stopping.set()
        self._responses.put(None)
        self._response_thread.join(timeout=10)
        self._watch_thread.join(timeout=5)
