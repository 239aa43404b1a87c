"""LoRA adapters loaded and unloaded at run time: vLLM's `POST /v1/load_lora_adapter`
(`{"lora_name", "lora_path"}`) and `POST /v1/unload_lora_adapter` (`{"lora_name"}`),
with vLLM's answers (200 "Success: ...", 400 for a bad or duplicate adapter, 404 for
unloading one that is not there).

They change what the server runs, so they need a caller the server knows: with API keys
(`--api-key`), the key every `/v1` route takes; without, the header `admin-key` holding
Triton's admin key. The frontend passes its own admin key on to the model
(backend/triton_server/engine_control.py checks it there too).

`model` (optional, ours): which Triton model gets the adapter, when more than one has
LoRA enabled.
"""

from __future__ import annotations

from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from frontend.openai_api import engine_control
from frontend.openai_api.engine_control import check_admin_header
from frontend.openai_api.errors import APIError
from frontend.openai_api.request_body import read_request
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


async def listed_adapters(client, model: str) -> Optional[list[str]]:
    """The adapters `model` serves now (loaded at start or since), or None when it cannot
    say (a backend without runtime LoRA)."""
    try:
        return list((await engine_control.control(client, model, {"lora_action": "list"}))["loaded"])
    except Exception:           # (an older backend, a stub being recovered): the config's list
        return None


def register(app: FastAPI, api_keys: bool, admin_key: Optional[str]) -> None:
    def authorize(request: Request) -> None:
        if not api_keys:            # (with them, the middleware checked the API key already: auth.py)
            check_admin_header(request, admin_key, "loading LoRA adapters at run time without API keys")

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
            return await engine_control.control(app.state.llm.client, model, {**params, "admin_key": admin_key or ""})
        except APIError as e:
            if "cannot be found" in e.message:
                raise APIError(404, e.message, "lora_name") from None
            if "admin key" in e.message or "admin_key" in e.message:    # the model's key is not this frontend's
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
