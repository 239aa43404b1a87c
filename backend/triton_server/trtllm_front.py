"""A model in TensorRT-LLM's contract (`ensemble`, `tensorrt_llm_bls`, `tensorrt_llm`) in
front of our `llm` model, over BLS: one engine and one copy of the weights behind every
name. Selected by the config.pbtxt parameter `trtllm_contract` ("text" or "tokens");
`llm_model` names the model it calls (default "llm").

Threads, as in model.py: execute() validates every batch row and starts one BLS reader
thread per row; readers put what `llm` streams on a queue; the response thread alone
sends to the client and polls its cancellation. Python backend 24.10 cannot cancel a
BLS request, so a cancelled or failed request stops its rows the way TensorRT-LLM's BLS
stops its engine: a `stop` request to `llm` with the row's request id.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.engine.errors import InvalidRequestError
from backend.triton_server.errors import triton_error
from backend.triton_server.trtllm_contract import (CONTRACTS, INPUT_SPECS, OUTPUT_SPECS, TOKENS, RowRequest,
                                                   batch_size, row_request, row_responses)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
LLM_OUTPUTS = ["text_output", "output_ids", "num_output_tokens", "cumulative_logprob", "logprobs"]


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
    rows: list[RowRequest]
    row_ids: list[str]
    remaining: int
    done: bool = False
    stopped: bool = False


class TrtLlmFront:
    def __init__(self, args: dict[str, Any], contract: str) -> None:
        config = json.loads(args["model_config"])
        self.contract = contract
        self.llm_model = ((config.get("parameters") or {}).get("llm_model") or {}).get("string_value") or "llm"
        self.input_names = [s["name"] for s in INPUT_SPECS[contract]]
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._pending: list[_Pending] = []
        self._thread = threading.Thread(target=self._response_loop, name="trtllm-responses", daemon=True)
        self._thread.start()

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
            # TensorRT-LLM's way to end a request: `stop` with that request's id.
            if not request.request_id():
                raise InvalidRequestError("input 'stop' needs the request_id of the request to stop")
            self._queue.put(("stop_id", request.request_id()))
            sender.send(flags=FINAL)
            return
        rows = [row_request(self.contract, inputs, b) for b in range(batch_size(self.contract, inputs))]
        prefix = request.request_id() or uuid.uuid4().hex
        pending = _Pending(request, sender, rows, [f"{prefix}/{uuid.uuid4().hex[:8]}" for _ in rows], len(rows))
        self._queue.put(("track", pending))
        for row, row_id in zip(rows, pending.row_ids):
            threading.Thread(target=self._read_row, args=(pending, row, row_id), daemon=True).start()

    def _read_row(self, pending: _Pending, row: RowRequest, row_id: str) -> None:
        try:
            bls = pb_utils.InferenceRequest(
                model_name=self.llm_model, request_id=row_id, requested_output_names=LLM_OUTPUTS,
                inputs=[pb_utils.Tensor(name, value) for name, value in row.inputs.items()])
            for response in bls.exec(decoupled=True):
                if response.has_error():
                    self._queue.put(("error", pending, response.error().message()))
                    return
                outputs = {name: t.as_numpy() for name in LLM_OUTPUTS
                           for t in [pb_utils.get_output_tensor_by_name(response, name)] if t is not None}
                if "num_output_tokens" not in outputs:  # the empty response that only says FINAL
                    continue
                for tensors in row_responses(self.contract, row, outputs):
                    self._queue.put(("send", pending, tensors))
        except Exception as e:
            self._queue.put(("error", pending, f"INTERNAL: {e!r}"))
        finally:
            self._queue.put(("row_done", pending))

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

    # -------------------------------------------------------------- responses
    def _response_loop(self) -> None:
        """The only thread that sends to clients and asks whether they cancelled (asking
        after the final response crashes the server, so both happen here, in order)."""
        while True:
            try:
                item = self._queue.get(timeout=0.02)
            except queue.Empty:
                item = ("poll",)
            if item is None:
                return
            kind = item[0]
            if kind == "track":
                self._pending.append(item[1])
            elif kind == "stop_id":
                for pending in self._pending:
                    if pending.request.request_id() == item[1]:
                        self._stop_rows(pending)  # each row then ends with what it has
            elif kind == "poll":
                for pending in self._pending:
                    if not pending.done and pending.request.is_cancelled():
                        self._finish(pending, pb_utils.InferenceResponse(error=pb_utils.TritonError(
                            "CANCELLED: the request was cancelled by the client", pb_utils.TritonError.CANCELLED)))
            else:
                self._handle(kind, *item[1:])
            self._pending = [p for p in self._pending if not p.done]

    def _handle(self, kind: str, pending: _Pending, *rest) -> None:
        if kind == "row_done":
            pending.remaining -= 1
            if pending.remaining == 0 and not pending.done:
                self._finish(pending, None)
        elif pending.done:
            return
        elif kind == "error":
            self._finish(pending, pb_utils.InferenceResponse(error=pb_utils.TritonError(rest[0])))
        else:
            tensors = [pb_utils.Tensor(name, value) for name, value in rest[0].items()]
            try:
                pending.sender.send(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception:
                self._finish(pending, None)

    def _finish(self, pending: _Pending, error_response) -> None:
        """Send FINAL once; rows still running are stopped."""
        pending.done = True
        if pending.remaining > 0:
            self._stop_rows(pending)
        try:
            if error_response is not None:
                pending.sender.send(error_response, flags=FINAL)
            else:
                pending.sender.send(flags=FINAL)
        except Exception:
            pass  # the client is gone

    def finalize(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
