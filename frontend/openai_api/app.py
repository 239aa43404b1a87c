"""OpenAI-compatible HTTP API in front of tritonserver: /v1/models (and /v1/models/{id}),
/v1/completions, /v1/chat/completions, /v1/embeddings (embeddings.py), /tokenize and
/detokenize (tokenization.py),
/metrics (metrics.py), /health. Each completion is one Triton request over gRPC
streaming; `stream: true` answers with server-sent events ending in `data: [DONE]`; a
client that disconnects cancels its Triton request (the backend frees its KV blocks).

With API keys set, every /v1 route takes `Authorization: Bearer <key>` (auth.py). A
request body over `max_request_body_bytes` is refused (413) before it is read whole.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from backend.engine.host_malloc import IDLE_TRIM_S, release_free_memory

from frontend.openai_api import completions as completion, embeddings, lora_adapters, metrics, sleep_routes, tokenization
from frontend.openai_api.auth import APIKeys, protected
from frontend.openai_api.chat import ChatTemplates
from frontend.openai_api.chat_content import checked_images
from frontend.openai_api.media_fetch import MediaFetcher
from frontend.openai_api.chat_completion import ChatCompletion, Shape
from frontend.openai_api.chat_output import ChoiceOutput
from frontend.openai_api.closing_stream import ClosingStreamingResponse, first_delta
from frontend.openai_api.request_log import RequestLog
from frontend.openai_api.errors import APIError, error_body
from frontend.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from frontend.openai_api.request_body import read_request
from frontend.openai_api.reasoning import REASONING_PARSERS, reasoning_sampling
from frontend.openai_api.responses import DEFAULT_RESPONSES_STORE_BYTES, register_responses
from frontend.openai_api.schemas import openapi
from frontend.openai_api.backend_health import BackendHealth
from frontend.openai_api.startup import preload_tokenizers
from frontend.openai_api.tools.choice import ToolConfig, plan
from frontend.openai_api.triton_client import (ClientDisconnected, Delta, Generation, TritonLLM, TritonTLS,
                                              cancelled_on_disconnect)

log = logging.getLogger("frontend")
# Room for a 128k-token prompt as token ids and long chat histories; far below what would
# hurt a server (uvicorn itself has no limit).
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024


async def _give_back_free_memory(app: FastAPI) -> None:
    """Every IDLE_TRIM_S with requests since the last time: the C heap's free pages back to
    the system (malloc_trim, about a millisecond), so that a burst of large bodies (15 MB
    prompts to /tokenize) does not leave the process at its high-water mark."""
    seen = 0
    while True:
        await asyncio.sleep(IDLE_TRIM_S)
        if app.state.requests_seen != seen:
            seen = app.state.requests_seen
            release_free_memory()


def create_app(triton_url: str, model_repository: Optional[str] = None, chat_template: Optional[str] = None,
               api_keys: Optional[APIKeys] = None, admin_headers: Optional[dict[str, str]] = None,
               max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
               request_log: Optional[RequestLog] = None, triton_tls: Optional[TritonTLS] = None,
               tool_config: ToolConfig = ToolConfig(), reasoning_parser: Optional[str] = None,
               responses_store_size: int = 1024,
               responses_store_bytes: int = DEFAULT_RESPONSES_STORE_BYTES,
               allowed_media_domains: tuple[str, ...] = (), backend_health_url: Optional[str] = None) -> FastAPI:
    """admin_headers: the gRPC headers of Triton's restricted model-repository and
    model-config groups, which listing the served models reads. request_log: off unless
    given enabled (prompts and outputs are the users' data). responses_store_size and
    responses_store_bytes bound the /v1/responses store (entries, and bytes in all).
    backend_health_url: the supervisor's /ready, read to fail fast while the backend
    cannot serve (backend_health.py)."""
    keys = api_keys or APIKeys()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # The gRPC channel belongs to the server's event loop: made here, not at import.
        health = BackendHealth(backend_health_url) if backend_health_url else None
        app.state.llm = TritonLLM(triton_url, model_repository, admin_headers=admin_headers, tls=triton_tls,
                                  health=health)
        if health is not None:
            health.start()
        preload = asyncio.create_task(preload_tokenizers(app.state.llm, app.state.chat))
        trim = asyncio.create_task(_give_back_free_memory(app))
        yield
        preload.cancel()
        trim.cancel()
        if health is not None:
            await health.close()
        await app.state.llm.close()
        await app.state.media.close()

    app = FastAPI(title="paged_llm OpenAI-compatible API", lifespan=lifespan)
    app.state.chat = ChatTemplates(chat_template)
    app.state.media = MediaFetcher(allowed_media_domains)      # images by URL (media_fetch.py)
    app.state.max_request_body_bytes = max_request_body_bytes
    app.state.request_log = request_log or RequestLog()
    app.state.tool_config = tool_config
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {sorted(REASONING_PARSERS)}, not {reasoning_parser!r}")
    app.state.reasoning_parser = REASONING_PARSERS[reasoning_parser] if reasoning_parser else None
    app.state.responses_store_size = responses_store_size
    app.state.responses_store_bytes = responses_store_bytes

    app.openapi = lambda: openapi(app, api_keys=bool(keys))    # the routes parse bodies themselves: schemas.py

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(HTTPException)     # no such route (404), or method (405): in our error shape too
    async def _http_error(_: Request, e: HTTPException) -> JSONResponse:
        response = APIError(e.status_code, str(e.detail)).response()
        response.headers.update(e.headers or {})
        return response

    @app.exception_handler(Exception)         # a bug: 500 in our error shape (uvicorn logs the traceback)
    async def _bug(_: Request, e: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {type(e).__name__}").response()

    app.state.requests_seen = 0             # (read by _give_back_free_memory)

    @app.middleware("http")
    async def _authenticate(request: Request, call_next):
        app.state.requests_seen += 1
        path = request.url.path
        if keys and protected(path):
            header = request.headers.get("authorization")
            if not keys.allows(header):
                what = "Missing API key: send 'Authorization: Bearer <key>'" if not header else \
                    "Incorrect API key provided"
                response = APIError(401, what).response()
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
        return await call_next(request)

    @app.get("/health")
    @app.get("/health/ready")             # Triton's OpenAI frontend's name for it
    async def health() -> JSONResponse:
        ok = await app.state.llm.ready()
        return JSONResponse(status_code=200 if ok else 503, content={"status": "ok" if ok else "unavailable"})

    @app.get("/v1/models")
    async def models() -> dict:
        served = await app.state.llm.models()
        return {"object": "list", "data": [_model_card(m) for m in served.values()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        return _model_card(await app.state.llm.model(model_id))      # 404 in OpenAI's shape when unknown

    tokenization.register(app)
    embeddings.register(app)
    # (the gRPC header's value: Triton's admin key, passed on to the model's LoRA control)
    admin_key = next(iter((admin_headers or {}).values()), None)
    lora_adapters.register(app, api_keys=bool(keys), admin_key=admin_key)
    sleep_routes.register(app, admin_key)
    metrics.register(app)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await read_request(request, CompletionRequest, app.state.max_request_body_bytes)
        embeddings.check_generates(await app.state.llm.model(req.model))
        gen, shape, sampling = await completion.start(app.state, req)      # completions.py
        app.state.request_log.received(shape.id, req.model, req.prompt, sampling)
        return await _respond(request, gen, req, shape)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await read_request(request, ChatCompletionRequest, app.state.max_request_body_bytes)
        served = await app.state.llm.model(req.model)
        embeddings.check_generates(served)
        served.check_n(req.n)
        sampling = req.sampling_parameters(req.max_completion_tokens or req.max_tokens)
        sampling.setdefault("max_tokens", None)          # OpenAI's default: up to the context length
        if req.logprobs:
            sampling["logprobs"] = req.top_logprobs or 0
        tools, tool_choice, legacy = req.tool_arguments()
        tool_plan = plan(tools, tool_choice, req.parallel_tool_calls, app.state.tool_config,
                         guided=any(k.startswith("guided_") for k in sampling), legacy=legacy)
        if tool_plan.guided_json is not None:
            sampling["guided_json"] = tool_plan.guided_json
        images = await app.state.media.inline(checked_images(
            [u for m in req.messages for u in m.image_urls()], served.accepts_images, req.model,
            app.state.media.allowed_domains))
        def render() -> tuple[list[dict], str, list[int]]:    # in a thread: 400k messages take seconds
            messages = [m.for_template() for m in req.messages]
            return (messages, *app.state.chat.render(served.checkpoint, req.model, messages, tool_plan.tools,
                                                     req.chat_template_kwargs, served.max_model_len))
        messages, text, ids = await asyncio.to_thread(render)
        reasoning = app.state.reasoning_parser
        if reasoning is not None:
            reasoning_sampling(reasoning(text), sampling, app.state.chat.tokenizer(served.checkpoint, req.model))
        shape = ChatCompletion(req, lambda: ChoiceOutput(reasoning(text) if reasoning else None,
                                                         tool_plan.parser(app.state.tool_config)), tool_plan)
        gen = app.state.llm.generate(req.model, ids, sampling, req.stream, req.logprobs, images)
        app.state.request_log.received(shape.id, req.model, messages, sampling)
        return await _respond(request, gen, req, shape)

    register_responses(app)
    return app


def _model_card(m) -> dict:
    return {"id": m.name, "object": "model", "created": m.created, "owned_by": "paged_llm", "root": m.triton_model,
            "parent": m.parent}


async def _respond(request: Request, gen: Generation, req, shape: Shape):
    deltas = gen.__aiter__()
    if req.stream:
        try:
            first = await first_delta(request, gen, deltas)
        except ClientDisconnected:
            log.info("client disconnected before the first token of %s; its request was cancelled", shape.id)
            return Response(status_code=499)
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return ClosingStreamingResponse(_events(gen, deltas, first, shape, usage, request.app.state.request_log),
                                        media_type="text/event-stream")
    try:
        async with cancelled_on_disconnect(request, gen):
            async for delta in deltas:
                shape.add(delta)
    except ClientDisconnected:          # one line, not a CancelledError traceback
        log.info("client disconnected before the answer to %s; its request was cancelled", shape.id)
        return Response(status_code=499)   # nginx's "client closed request": nobody reads it
    finally:
        request.app.state.request_log.finished(shape.id, shape.texts, shape.finish)
    return shape.whole()


async def _events(gen: Generation, deltas, first: Optional[Delta], shape: Shape,
                  include_usage: bool, request_log: RequestLog) -> AsyncIterator[str]:
    try:
        for chunk in shape.opening():
            yield _sse(chunk, include_usage)
        if first is not None:
            shape.add(first)
            yield _sse(shape.chunk(first), include_usage)
        async for delta in deltas:
            shape.add(delta)
            yield _sse(shape.chunk(delta), include_usage)
        if include_usage:
            yield _sse({**shape.base(), "choices": [], "usage": shape.usage()}, False)
        yield "data: [DONE]\n\n"
    except ClientDisconnected:  # cancelled as the first token came: nobody is reading
        return
    except APIError as e:       # after the 200: the error as an event, as OpenAI does
        yield f"data: {json.dumps(error_body(e.status, e.message, e.param))}\n\n"
    finally:
        gen.cancel()            # the client left, or the request is over: end it in Triton
        request_log.finished(shape.id, shape.texts, shape.finish)


def _sse(chunk: dict, include_usage: bool) -> str:
    if include_usage:
        chunk = {**chunk, "usage": None}
    return f"data: {json.dumps(chunk)}\n\n"
