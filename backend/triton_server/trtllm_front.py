"""A model in TensorRT-LLM's contract (`ensemble`, `tensorrt_llm_bls`, `tensorrt_llm`) in
front of our `llm` model, over BLS: one engine and one copy of the weights behind every
name. Selected by the config.pbtxt parameter `trtllm_contract` ("text" or "tokens");
`llm_model` names the model it calls (default "llm").

As TensorRT-LLM's own BLS model does it, execute() serves its requests in its own thread,
start to end: it sends each batch row to `llm`, then reads the rows' streams in order and
sends what they carry, converted, to the client. Concurrency comes from model instances
(`instance_group` count), each its own process. Python backend 24.10's stub crashed
(segfaults under perf_analyzer and genai-perf) when BLS requests ran from threads of our
own, so there are none.

Python backend 24.10 cannot cancel a BLS request, so a cancelled or failed request stops
its rows the way TensorRT-LLM's BLS stops its engine: a `stop` request to `llm` under
the rows' request id, which ends them with what they have.

Python backend 24.10 also frees numpy arrays without the GIL in two places, which
corrupts the stub's heap (segfaults, garbled tensors, a stub found dead under
perf_analyzer; python_backend #390, fixed in 24.12). Its response sender drops outputs the
client did not ask for that way: we send only those asked for (inference_response). And
a finished BLS stream is freed, with every response it read, by the thread that sends
its cleanup to the server, whenever the stub's map of streams holds the last reference:
we keep each stream until that cleanup is surely done (_release_streams).
"""

from __future__ import annotations

import json
import secrets
import sys
import uuid
from typing import Any, Optional

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.engine.errors import InvalidRequestError
from backend.triton_server.errors import triton_error
from backend.triton_server.response_writer import inference_response
from backend.triton_server.stop_key import STOP_KEY, required_stop_key, stop_key_of
from backend.triton_server.trtllm_contract import (CONTRACTS, INPUT_SPECS, OUTPUT_SPECS, TOKENS, RowRequest,
                                                   batch_size, is_last, row_request, row_responses)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Under the supervisor a front writes a health report too (its stub can crash natively),
# and a heartbeat older than this reads as a hung stub. Its heartbeat thread runs while
# execute() waits on a BLS stream (the stub releases the GIL there: checked by
# tests/integration/test_recovery.py), so only a hang that holds the GIL stops it.
STALE_AFTER_S = 60.0
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


class _Request:
    """One client request being served: its rows' streams, and whether FINAL went out."""

    def __init__(self, request, sender, row_id: str, num_rows: int, stop_key: str) -> None:
        self.request, self.sender, self.row_id = request, sender, row_id
        self.stop_key = stop_key  # the rows' in `llm`: the client's own, or one only we know
        self.requested_outputs = frozenset(request.requested_output_names())
        self.open_rows = num_rows
        self.done = False
        self.stopped = False


class TrtLlmFront:
    def __init__(self, args: dict[str, Any], contract: str) -> None:
        config = json.loads(args["model_config"])
        self.contract = contract
        self.llm_model = ((config.get("parameters") or {}).get("llm_model") or {}).get("string_value") or "llm"
        self.input_names = [s["name"] for s in INPUT_SPECS[contract]]
        # BLS streams read to their end, kept past their cleanup (the last request's stay
        # until the stub exits, whose interpreter frees them with the GIL)
        self._read_streams: list = []

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._serve(request, sender)
            except Exception as e:  # one bad request fails alone
                if not isinstance(e, InvalidRequestError):
                    print(f"[paged_llm] {self.contract} request failed: {e!r}", file=sys.stderr, flush=True)
                sender.send(pb_utils.InferenceResponse(error=triton_error(e)), flags=FINAL)
        return None

    def _serve(self, request, sender) -> None:
        inputs = {}
        for name in self.input_names:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        if self.contract == TOKENS and "stop" in inputs and bool(inputs["stop"].reshape(-1)[0]):
            # TensorRT-LLM's way to end a request: `stop` with that request's id. Its rows
            # run in `llm` under that id (whichever instance serves them).
            if not request.request_id():
                raise InvalidRequestError("input 'stop' needs the request_id of the request to stop")
            self._stop(request.request_id(), required_stop_key(request.parameters()))
            self._release_streams(request)
            sender.send(flags=FINAL)
            return
        rows = [row_request(self.contract, inputs, b) for b in range(batch_size(self.contract, inputs))]
        # "<client's id>/<unique>": the rows stop alone, and a `stop` under the client's id
        # and with its stop_key (to any instance) stops them too. Without one, a key no
        # client knows: only this front can stop them.
        served = _Request(request, sender, f"{request.request_id()}/{uuid.uuid4().hex[:12]}", len(rows),
                          stop_key_of(request.parameters()) or secrets.token_hex(16))
        # Every row goes to `llm` first, so the engine batches them; their streams are
        # then read in order (what arrives meanwhile waits in each iterator).
        streams = [self._exec(served, row) for row in rows]
        for row, stream in zip(rows, streams):
            self._read_row(served, row, stream)
            self._read_streams.append(stream)

    def _exec(self, served: _Request, row: RowRequest):
        bls = pb_utils.InferenceRequest(model_name=self.llm_model, request_id=served.row_id,
                                        requested_output_names=LLM_OUTPUTS,
                                        inputs=[pb_utils.Tensor(name, value) for name, value in row.inputs.items()],
                                        parameters={STOP_KEY: served.stop_key})
        return bls.exec(decoupled=True)

    def _read_row(self, served: _Request, row: RowRequest, stream) -> None:
        last = False
        try:
            for response in stream:
                if response.has_error():
                    self._end(served, pb_utils.TritonError(response.error().message()))
                    continue  # read on to the end of the row's stream
                outputs = {name: t.as_numpy() for name in LLM_OUTPUTS
                           for t in [pb_utils.get_output_tensor_by_name(response, name)] if t is not None}
                if "num_output_tokens" not in outputs:  # the empty response that only says FINAL
                    continue
                last = is_last(outputs)
                self._send(served, row_responses(self.contract, row, outputs), last)
        except Exception as e:
            self._end(served, pb_utils.TritonError(f"INTERNAL: {e!r}"))
        if not last:
            # llm ended the row without its last response: it failed or was cancelled
            # there (the error itself does not reach a BLS caller in 24.10).
            self._end(served, pb_utils.TritonError(
                f"UNAVAILABLE: the request to model '{self.llm_model}' ended without its final response "
                "(it failed or was cancelled there; the server log says why)", pb_utils.TritonError.UNAVAILABLE))

    def _send(self, served: _Request, responses: list[dict], last: bool) -> None:
        if served.done:
            return
        served.open_rows -= last
        final = last and served.open_rows == 0
        if final:
            self._release_streams(served.request)
        try:
            for i, tensors in enumerate(responses):
                # The last data response carries FINAL itself: clients that do not ask
                # for empty final responses (perf_analyzer) learn the end from it.
                flags = FINAL if final and i == len(responses) - 1 else 0
                served.sender.send(inference_response(tensors, served.requested_outputs), flags=flags)
            if final and not responses:
                served.sender.send(flags=FINAL)
        except Exception:
            final = True  # the client is gone
            self._stop_rows(served)
        if final:
            served.done = True
        elif served.request.is_cancelled():  # never asked after FINAL: that crashes the server
            self._end(served, pb_utils.TritonError("CANCELLED: the request was cancelled by the client",
                                                   pb_utils.TritonError.CANCELLED))

    def _end(self, served: _Request, error) -> None:
        """Send the error as FINAL, once, and stop the rows still running."""
        if served.done:
            return
        served.done = True
        self._release_streams(served.request)
        try:
            served.sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
        except Exception:
            pass  # the client is gone
        if served.open_rows > 0:
            self._stop_rows(served)

    def _stop_rows(self, served: _Request) -> None:
        if not served.stopped:
            served.stopped = True
            self._stop(served.row_id, served.stop_key)

    def _stop(self, request_id: str, stop_key: str) -> None:
        bls = pb_utils.InferenceRequest(model_name=self.llm_model, request_id=request_id, requested_output_names=[],
                                        inputs=[pb_utils.Tensor("stop", np.array([True]))],
                                        parameters={STOP_KEY: stop_key})
        stream = bls.exec(decoupled=True)
        for response in stream:
            if response.has_error():
                print(f"[paged_llm] could not stop {request_id}: {response.error().message()}", file=sys.stderr,
                      flush=True)
        self._read_streams.append(stream)

    def _release_streams(self, request) -> None:
        """Drop the streams read to their end before now, once the stub has dropped its own
        reference to each (else its sender thread frees them without the GIL). A stream
        queues its cleanup, for that thread, when its last response is read; an
        is_cancelled query is queued behind it, and returns once the thread has answered
        it. Asked before the request's FINAL only (after it, it crashes the server); a
        cached answer (already cancelled) asks nothing and proves nothing."""
        if self._read_streams and not request.is_cancelled():
            self._read_streams.clear()
