"""The frontend's side of engine_control (backend/triton_server/engine_control.py): one
control request to a Triton model of ours, and the admin-key check of the routes that
change what the server runs (LoRA adapters at run time, sleep mode)."""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Optional

import numpy as np
import tritonclient.grpc as grpcclient
from fastapi import Request
from tritonclient.utils import InferenceServerException

from frontend.openai_api.errors import APIError, from_triton

ADMIN_HEADER = "admin-key"


async def control(client, model: str, params: dict, timeout_s: float = 660.0) -> dict:
    """One control request to `model`: its JSON answer (APIError for a refusal). The
    stream is read to its end, not cancelled after the answer: a cancel that overtakes
    the backend's release of the request leaves it behind in Triton 24.10, and the model
    then never unloads (triton_client.Generation does the same)."""
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b""], dtype=np.object_))

    async def requests():
        yield {"model_name": model, "inputs": [text], "parameters": params,
               "outputs": [grpcclient.InferRequestedOutput("text_output")]}
    call = client.stream_infer(requests())

    async def read() -> dict:
        answer, failure = None, None
        async for result, error in call:        # (our side half-closes after the one request)
            if error is not None:
                failure = failure or from_triton(str(error.message() if hasattr(error, "message") else error))
            elif answer is None:
                answer = json.loads(result.as_numpy("text_output").reshape(-1)[0].decode())
        if failure is not None:
            raise failure
        if answer is None:
            raise APIError(500, f"model '{model}' did not answer the control request")
        return answer
    try:
        return await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        call.cancel()
        raise APIError(503, f"model '{model}' did not answer the control request in {timeout_s:g} s") from None
    except InferenceServerException as e:
        raise from_triton(e.message() or str(e)) from None


def check_admin_header(request: Request, admin_key: Optional[str], what: str) -> None:
    """The header `admin-key` must hold Triton's admin key (constant-time compare)."""
    if admin_key is None:
        raise APIError(403, f"{what} needs the server's admin key, and this frontend has none (TRITON_ADMIN_KEY)")
    sent = request.headers.get(ADMIN_HEADER)
    if sent is None or not hmac.compare_digest(sent.encode(), admin_key.encode()):
        raise APIError(401, f"{what} needs the header '{ADMIN_HEADER}' (Triton's admin key)")
