"""LoRA adapters loaded and unloaded at run time: vLLM's `POST /v1/load_lora_adapter`
(`{"lora_name", "lora_path"}`) and `POST /v1/unload_lora_adapter` (`{"lora_name"}`),
with vLLM's answers (200 "Success: ...", 400 for a bad or duplicate adapter, 404 for
unloading one that is not there).

They change what the server runs, so they need a caller the server knows: with API keys
(`--api-key`), the key every `/v1` route takes; without, the header `admin-key` holding
Triton's admin key. The frontend passes its own admin key on to the model
(backend/triton_server/lora_control.py checks it there too).

`model` (optional, ours): which Triton model gets the adapter, when more than one has
LoRA enabled.
"""

from __future__ import annotations

import hmac
import json
from typing import Optional

import numpy as np
import tritonclient.grpc as grpcclient
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict
from tritonclient.utils import InferenceServerException

from frontend.openai_api.errors import APIError, from_triton
from frontend.openai_api.request_body import read_request

ADMIN_HEADER = "admin-key"
# Without API keys these still answer 401: they take the admin key then.
ADMIN_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    model: Optional[str] = None


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: Optional[int] = None       # vLLM's; names are what identify adapters here
    model: Optional[str] = None


async def control(client, model: str, params: dict) -> dict:
    """One control request to `model` (lora_control.py's contract): its JSON answer."""
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b""], dtype=np.object_))

    async def requests():
        yield {"model_name": model, "inputs": [text], "parameters": params,
               "outputs": [grpcclient.InferRequestedOutput("text_output")]}
    call = client.stream_infer(requests())
    try:
        async for result, error in call:
            if error is not None:
                raise from_triton(str(error.message() if hasattr(error, "message") else error))
            return json.loads(result.as_numpy("text_output").reshape(-1)[0].decode())
    except InferenceServerException as e:
        raise from_triton(e.message() or str(e)) from None
    finally:
        call.cancel()
    raise APIError(500, f"model '{model}' did not answer the LoRA request")


async def listed_adapters(client, model: str) -> Optional[list[str]]:
    """The adapters `model` serves now (loaded at start or since), or None when it cannot
    say (a backend without runtime LoRA)."""
    try:
        return list((await control(client, model, {"lora_action": "list"}))["loaded"])
    except Exception:           # (an older backend, a stub being recovered): the config's list
        return None


def register(app: FastAPI, api_keys: bool, admin_key: Optional[str]) -> None:
    def authorize(request: Request) -> None:
        if api_keys:
            return                  # the middleware checked the API key already (auth.py)
        sent = request.headers.get(ADMIN_HEADER)
        if admin_key is None:
            raise APIError(403, "loading LoRA adapters at run time needs the server's API key (--api-key) or "
                                "its admin key, and this frontend has neither")
        if sent is None or not hmac.compare_digest(sent.encode(), admin_key.encode()):
            raise APIError(401, f"loading LoRA adapters at run time needs the header '{ADMIN_HEADER}' "
                                "(Triton's admin key) when the server has no API key")

    async def target(model: Optional[str]) -> str:
        served = await app.state.llm.models()
        enabled = [m.name for m in served.values() if m.lora_enabled and m.lora_name is None]
        if model is not None:
            if model not in enabled:
                raise APIError(400 if model in served else 404,
                               f"model '{model}' does not take LoRA adapters (engine argument enable_lora)", "model")
            return model
        if not enabled:
            raise APIError(400, "no model here takes LoRA adapters: start one with the engine argument enable_lora")
        if len(enabled) > 1:
            raise APIError(400, f"several models take LoRA adapters ({', '.join(enabled)}): name one in 'model'",
                           "model")
        return enabled[0]

    async def change(params: dict) -> dict:
        model = await target(params.pop("model"))
        try:
            return await control(app.state.llm.client, model, {**params, "admin_key": admin_key or ""})
        except APIError as e:
            if "cannot be found" in e.message:
                raise APIError(404, e.message, "lora_name") from None
            if "admin key" in e.message:        # the model's key is not the one this frontend holds
                raise APIError(403, e.message) from None
            raise
        finally:
            app.state.llm.forget_models()       # the listing shows the change at once

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        authorize(request)
        req = await read_request(request, LoadLoRAAdapterRequest, app.state.max_request_body_bytes)
        await change({"lora_action": "load", "lora_name": req.lora_name, "lora_path": req.lora_path,
                               "model": req.model})
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        authorize(request)
        req = await read_request(request, UnloadLoRAAdapterRequest, app.state.max_request_body_bytes)
        out = await change({"lora_action": "unload", "lora_name": req.lora_name, "model": req.model})
        later = " It is dropped once its running requests finish." if out.get("status") == "unloading" else ""
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.{later}")
