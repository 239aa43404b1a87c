"""vLLM's sleep mode routes: `POST /sleep?level=1|2`, `POST /wake_up` and `GET
/is_sleeping` (`{"is_sleeping": bool}`), for co-located training and rollouts: the
engine frees its KV cache (level 1; on CUDA the weights go to host memory) or its
weights too (level 2) and wakes up with the same outputs
(backend/engine/sleep_mode.py).

They change what the server runs, so all three take the header `admin-key` holding
Triton's admin key, API keys or not (vLLM serves them only in its dev mode). They apply
to every base model of ours that Triton serves, or to the one `?model=` names. A model
that is serving requests refuses to sleep (400). While a model sleeps, its requests get a
retryable 503.
"""

from __future__ import annotations

from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import Response

from frontend.openai_api import engine_control
from frontend.openai_api.engine_control import check_admin_header
from frontend.openai_api.errors import APIError

ROUTES = ("/sleep", "/wake_up", "/is_sleeping")


def register(app: FastAPI, admin_key: Optional[str]) -> None:
    async def targets(model: Optional[str]) -> list[str]:
        served = await app.state.llm.models()
        names = [m.name for m in served.values() if m.lora_name is None]
        if model is not None:
            if model not in names:
                raise APIError(404, f"The model '{model}' does not exist", "model")
            return [model]
        return names

    async def each(request: Request, model: Optional[str], params: dict) -> list[dict]:
        check_admin_header(request, admin_key, "sleep mode")
        return [await engine_control.control(app.state.llm.client, name, {**params, "admin_key": admin_key})
                for name in await targets(model)]

    @app.post("/sleep")
    async def sleep(request: Request, level: str = "1", model: Optional[str] = None) -> Response:
        if level not in ("1", "2"):         # (read as text: a 400 in our shape, not FastAPI's 422)
            raise APIError(400, f"invalid 'level': {level!r}; 1 frees the KV cache (weights to host memory), 2 "
                                "the weights too", "level")
        await each(request, model, {"sleep_action": "sleep", "level": int(level)})
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(request: Request, model: Optional[str] = None) -> Response:
        await each(request, model, {"sleep_action": "wake_up"})
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping(request: Request, model: Optional[str] = None) -> dict:
        answers = await each(request, model, {"sleep_action": "is_sleeping"})
        return {"is_sleeping": any(a.get("is_sleeping") for a in answers)}
