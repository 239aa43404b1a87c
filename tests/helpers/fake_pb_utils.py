"""A stand-in `triton_python_backend_utils` for unit tests of the adapter's response side
(response_writer.py, trtllm_front.py), with what Python backend 24.10 does that they
must work around, modelled so that a test can fail on it:

- A response sender drops the outputs its request did not ask for (`dropped` records
  them: the real one frees them without the GIL).
- A BLS stream read to its end queues a cleanup on the stub's one sender thread, and
  its map of streams keeps its own reference until that thread has run it. An
  `is_cancelled` query is queued behind it and returns once the thread has answered.
  A stream whose last Python reference goes while its cleanup is still queued would be
  freed by that thread, without the GIL: `freed_off_gil` records it.
"""

from __future__ import annotations

import types
import weakref
from typing import Callable, Optional

import numpy as np

FINAL = 1


class TritonError:
    INTERNAL, INVALID_ARG, UNAVAILABLE, CANCELLED = 13, 3, 14, 1

    def __init__(self, msg: str, code: int = INTERNAL) -> None:
        self._msg, self._code = msg, code

    def message(self) -> str:
        return self._msg

    def code(self) -> int:
        return self._code


class Tensor:
    def __init__(self, name: str, value: np.ndarray) -> None:
        self._name, self._value = name, value

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._value


class InferenceResponse:
    def __init__(self, output_tensors: Optional[list] = None, error: Optional[TritonError] = None) -> None:
        self._tensors, self._error = list(output_tensors or []), error

    def output_tensors(self) -> list:
        return self._tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> Optional[TritonError]:
        return self._error


def get_input_tensor_by_name(request, name: str) -> Optional[Tensor]:
    return next((t for t in request.inputs if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Optional[Tensor]:
    return next((t for t in response.output_tensors() if t.name() == name), None)


class Stub:
    """One stub process's state: its sender thread's queue and what the tests observe."""

    def __init__(self) -> None:
        self.queue: list[int] = []             # stream ids whose cleanup is queued
        self.freed_off_gil: list[int] = []     # streams freed while their cleanup was queued
        self.queries_after_final: list[str] = []
        self.dropped: list[str] = []           # outputs a sender dropped
        self.bls: Callable[["InferenceRequest"], list[InferenceResponse]] = lambda request: []
        self.bls_requests: list["InferenceRequest"] = []

    def run_sender_thread(self) -> None:
        self.queue.clear()


class Stream:
    """A BLS response iterator."""
    _ids = iter(range(1, 1 << 30))

    def __init__(self, stub: Stub, responses: list[InferenceResponse]) -> None:
        self.stub, self.id, self._left = stub, next(Stream._ids), list(responses)
        weakref.finalize(self, Stream._freed, stub, self.id)

    @staticmethod
    def _freed(stub: Stub, stream_id: int) -> None:
        if stream_id in stub.queue:
            stub.freed_off_gil.append(stream_id)

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> InferenceResponse:
        if not self._left:
            raise StopIteration
        response = self._left.pop(0)
        if not self._left:
            self.stub.queue.append(self.id)   # queued as the last response is read
        return response


class InferenceRequest:
    stub: Stub   # set on the class by install()

    def __init__(self, model_name: str, inputs: list, request_id: str = "",
                 requested_output_names: Optional[list] = None, parameters: Optional[dict] = None, **_) -> None:
        self.model_name, self.inputs, self.request_id = model_name, inputs, request_id
        self.requested_output_names = requested_output_names
        self.parameters = dict(parameters or {})

    def exec(self, decoupled: bool = False) -> Stream:
        self.stub.bls_requests.append(self)
        return Stream(self.stub, self.stub.bls(self))


class Sender:
    def __init__(self, request: "ClientRequest") -> None:
        self.request = request
        self.sent: list[tuple[Optional[InferenceResponse], int]] = []

    def send(self, response: Optional[InferenceResponse] = None, flags: int = 0) -> None:
        if response is not None:
            for t in response.output_tensors():
                if t.name() not in self.request.requested:
                    self.request.stub.dropped.append(t.name())
        self.sent.append((response, flags))
        if flags & FINAL:
            self.request.final_sent = True


class ClientRequest:
    """A request as execute() receives it."""

    def __init__(self, stub: Stub, inputs: dict[str, np.ndarray], requested: list[str],
                 request_id: str = "r1", parameters: str = "") -> None:
        self.stub, self.requested, self._id, self._parameters = stub, list(requested), request_id, parameters
        self.inputs = [Tensor(name, value) for name, value in inputs.items()]
        self.sender = Sender(self)
        self.final_sent = False

    def get_response_sender(self) -> Sender:
        return self.sender

    def requested_output_names(self) -> list[str]:
        return self.requested

    def request_id(self) -> str:
        return self._id

    def parameters(self) -> str:
        return self._parameters

    def is_cancelled(self) -> bool:
        if self.final_sent:
            self.stub.queries_after_final.append(self._id)
        self.stub.run_sender_thread()   # answered once every earlier message is
        return False


def install(stub: Stub) -> types.ModuleType:
    module = types.ModuleType("triton_python_backend_utils")
    module.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    module.TritonError, module.Tensor, module.InferenceResponse = TritonError, Tensor, InferenceResponse
    module.get_input_tensor_by_name, module.get_output_tensor_by_name = get_input_tensor_by_name, \
        get_output_tensor_by_name
    module.InferenceRequest = type("InferenceRequest", (InferenceRequest,), {"stub": stub})
    return module
