"""A model in TensorRT-LLM's contract (`ensemble`, `tensorrt_llm_bls`, `tensorrt_llm`) in
front of our `llm` model, over BLS: one engine and one copy of the weights behind every
name. Selected by the config.pbtxt parameter `trtllm_contract` ("text" or "tokens");
`llm_model` names the model it calls (default "llm").

Threads: execute() validates every batch row and starts one thread per row, which runs
the BLS request to `llm` and sends what it streams back, converted, to the client. A row's
responses are converted and sent by the thread that received them: handing them to
another thread to send crashed the 24.10 stub under perf_analyzer. The rows of a request
share a lock, so one of them sends FINAL, once, and only before it does anyone ask
whether the client cancelled (asking after FINAL crashes the server). Python backend
24.10 cannot cancel a BLS request, so a cancelled or failed request stops its rows the
way TensorRT-LLM's BLS stops its engine: a `stop` request to `llm` with the row's id.
"""

from __future__ import annotations

import json
import sys
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.engine.errors import InvalidRequestError
from backend.triton_server.errors import triton_error
from backend.triton_server.trtllm_contract import (CONTRACTS, INPUT_SPECS, OUTPUT_SPECS, TOKENS, RowRequest,
                                                   batch_size, is_last, row_request, row_responses)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
LLM_OUTPUTS = ["text_output", "output_ids", "num_output_tokens", "finish_reason", "cumulative_logprob", "logprobs"]


def contract_of(model_config: dict) -> Optional[str]:
    value = ((model_config.get("parameters") or {}).get("trtllm_contract") or {}).get("string_value")
    if value is not None and value not in CONTRACTS:
        raise ValueError(f"invalid parameter 'trtllm_contract': {value!r}; expected one of {list(CONTRACTS)}")
    return value


def auto_complete_config(config, contract: str):
    have_in = {i["name"] for i in config.as_dict().get("input", [])}
    have_out = {o["name"] for o in config.as_dict().get("output", [])}
    for spec in INPUT_SPECS[contract]:
        if spec["name"] not in have_in:
            config.add_input(spec)
    for spec in OUTPUT_SPECS[contract]:
        if spec["name"] not in have_out:
            config.add_output(spec)
    config.set_model_transaction_policy(dict(decoupled=True))
    if config.as_dict().get("max_batch_size", 0) == 0:
        config.set_max_batch_size(64)  # TensorRT-LLM's models take [batch, ...] tensors
    return config


@dataclass
class _Pending:
    request: Any
    sender: Any
    row_ids: list[str]
    open_rows: int    # rows whose last response has not been sent
    done: bool = False
    stopped: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class TrtLlmFront:
    def __init__(self, args: dict[str, Any], contract: str) -> None:
        config = json.loads(args["model_config"])
        self.contract = contract
        self.llm_model = ((config.get("parameters") or {}).get("llm_model") or {}).get("string_value") or "llm"
        self.input_names = [s["name"] for s in INPUT_SPECS[contract]]
        self._pending: dict[int, _Pending] = {}  # by id(): the requests not yet final
        self._pending_lock = threading.Lock()

    # ------------------------------------------------------------------ serve
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(request, sender)
            except Exception as e:  # one bad request fails alone
                if not isinstance(e, InvalidRequestError):
                    print(f"[paged_llm] {self.contract} request failed: {e!r}", file=sys.stderr, flush=True)
                sender.send(pb_utils.InferenceResponse(error=triton_error(e)), flags=FINAL)
        return None

    def _submit(self, request, sender) -> None:
        inputs = {}
        for name in self.input_names:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        if self.contract == TOKENS and "stop" in inputs and bool(inputs["stop"].reshape(-1)[0]):
            # TensorRT-LLM's way to end a request: `stop` with that request's id. Each
            # row then ends with what it has.
            if not request.request_id():
                raise InvalidRequestError("input 'stop' needs the request_id of the request to stop")
            with self._pending_lock:
                targets = [p for p in self._pending.values() if p.request.request_id() == request.request_id()]
            for pending in targets:
                self._stop_rows(pending)
            sender.send(flags=FINAL)
            return
        rows = [row_request(self.contract, inputs, b) for b in range(batch_size(self.contract, inputs))]
        prefix = request.request_id() or uuid.uuid4().hex
        pending = _Pending(request, sender, [f"{prefix}/{uuid.uuid4().hex[:8]}" for _ in rows], len(rows))
        with self._pending_lock:
            self._pending[id(pending)] = pending
        for row, row_id in zip(rows, pending.row_ids):
            threading.Thread(target=self._serve_row, args=(pending, row, row_id), daemon=True).start()

    def _serve_row(self, pending: _Pending, row: RowRequest, row_id: str) -> None:
        last = False
        try:
            bls = pb_utils.InferenceRequest(
                model_name=self.llm_model, request_id=row_id, requested_output_names=LLM_OUTPUTS,
                inputs=[pb_utils.Tensor(name, value) for name, value in row.inputs.items()])
            for response in bls.exec(decoupled=True):
                if response.has_error():
                    self._fail(pending, pb_utils.TritonError(response.error().message()))
                    continue  # read on to the end of the row's stream
                outputs = {name: t.as_numpy() for name in LLM_OUTPUTS
                           for t in [pb_utils.get_output_tensor_by_name(response, name)] if t is not None}
                if "num_output_tokens" not in outputs:  # the empty response that only says FINAL
                    continue
                last = is_last(outputs)
                self._send(pending, row_responses(self.contract, row, outputs), last)
        except Exception as e:
            self._fail(pending, pb_utils.TritonError(f"INTERNAL: {e!r}"))
        if not last:
            # llm ended the row without its last response: it failed or was cancelled
            # there (the error itself does not reach a BLS caller in 24.10).
            self._fail(pending, pb_utils.TritonError(
                f"UNAVAILABLE: the request to model '{self.llm_model}' ended without its final response "
                "(it failed or was cancelled there; the server log says why)", pb_utils.TritonError.UNAVAILABLE))

    def _send(self, pending: _Pending, responses: list[dict], last: bool) -> None:
        with pending.lock:
            if pending.done:
                return
            pending.open_rows -= last
            final = last and pending.open_rows == 0
            try:
                for i, tensors in enumerate(responses):
                    # The last data response carries FINAL itself: clients that do not
                    # ask for empty final responses (perf_analyzer) learn the end from it.
                    flags = FINAL if final and i == len(responses) - 1 else 0
                    pending.sender.send(pb_utils.InferenceResponse(
                        output_tensors=[pb_utils.Tensor(name, value) for name, value in tensors.items()]), flags=flags)
                if final and not responses:
                    pending.sender.send(flags=FINAL)
            except Exception:
                final = True  # the client is gone
            if final:
                self._close(pending)
            elif pending.request.is_cancelled():
                self._end(pending, pb_utils.TritonError("CANCELLED: the request was cancelled by the client",
                                                        pb_utils.TritonError.CANCELLED))

    def _fail(self, pending: _Pending, error) -> None:
        with pending.lock:
            if not pending.done:
                self._end(pending, error)

    def _end(self, pending: _Pending, error) -> None:
        """Send the error as FINAL and stop the rows still running (pending.lock held)."""
        try:
            pending.sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
        except Exception:
            pass  # the client is gone
        self._close(pending)
        if pending.open_rows > 0:
            self._stop_rows(pending)

    def _close(self, pending: _Pending) -> None:
        pending.done = True
        with self._pending_lock:
            self._pending.pop(id(pending), None)

    def _stop(self, request_id: str) -> None:
        bls = pb_utils.InferenceRequest(model_name=self.llm_model, request_id=request_id, requested_output_names=[],
                                        inputs=[pb_utils.Tensor("stop", np.array([True]))])
        for response in bls.exec(decoupled=True):
            if response.has_error():
                raise InvalidRequestError(response.error().message())

    def _stop_rows(self, pending: _Pending) -> None:
        if pending.stopped:
            return
        pending.stopped = True

        def stop_all() -> None:
            for row_id in pending.row_ids:
                try:
                    self._stop(row_id)
                except Exception as e:
                    print(f"[paged_llm] could not stop {row_id}: {e!r}", file=sys.stderr, flush=True)
        threading.Thread(target=stop_all, daemon=True).start()
