"""The request tensors of the vLLM backend's contract (text or token ids, stream,
sampling parameters as JSON, and the outputs to return), as tritonclient gRPC inputs:
what the OpenAI frontend sends `llm`, and what the command-line clients send too."""

from __future__ import annotations

import json
from typing import Any, Optional

import numpy as np
import tritonclient.grpc as grpcclient


def make_inputs(prompt: Optional[str], sampling: Optional[dict[str, Any]] = None, stream: bool = True,
                input_ids: Optional[list[int]] = None, extra: Optional[dict[str, np.ndarray]] = None
                ) -> list[grpcclient.InferInput]:
    tensors: dict[str, np.ndarray] = {}
    if prompt is not None:
        tensors["text_input"] = np.array([prompt.encode("utf-8")], dtype=np.object_)
    if input_ids is not None:
        tensors["input_ids"] = np.array(input_ids, dtype=np.int32)
    tensors["stream"] = np.array([stream], dtype=bool)
    if sampling is not None:
        tensors["sampling_parameters"] = np.array([json.dumps(sampling).encode()], dtype=np.object_)
    tensors["return_finish_reason"] = np.array([True], dtype=bool)
    tensors["return_num_output_tokens"] = np.array([True], dtype=bool)
    tensors.update(extra or {})
    inputs = []
    for name, arr in tensors.items():
        dtype = "BYTES" if arr.dtype == np.object_ else grpcclient.np_to_triton_dtype(arr.dtype)
        inp = grpcclient.InferInput(name, list(arr.shape), dtype)
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs
