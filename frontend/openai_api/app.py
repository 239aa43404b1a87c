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
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from frontend.openai_api import embeddings, metrics, tokenization
from frontend.openai_api.auth import APIKeys, protected
from frontend.openai_api.chat import ChatTemplates
from frontend.openai_api.request_log import RequestLog
from frontend.openai_api.errors import APIError, error_body
from frontend.openai_api.protocol import ChatCompletionRequest, CompletionRequest, parse, read_json
from frontend.openai_api.schemas import openapi
from frontend.openai_api.triton_client import Delta, Generation, TritonLLM, TritonTLS

FINISH = {"stop": "stop", "length": "length", "abort": "stop"}
# Room for a 128k-token prompt as token ids and long chat histories; far below what would
# hurt a server (uvicorn itself has no limit).
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024


def create_app(triton_url: str, model_repository: Optional[str] = None, chat_template: Optional[str] = None,
               api_keys: Optional[APIKeys] = None, admin_headers: Optional[dict[str, str]] = None,
               max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
               request_log: Optional[RequestLog] = None, triton_tls: Optional[TritonTLS] = None) -> FastAPI:
    """admin_headers: the gRPC headers of Triton's restricted model-repository and
    model-config groups, which listing the served models reads. request_log: off unless
    given enabled (prompts and outputs are the users' data)."""
    keys = api_keys or APIKeys()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # The gRPC channel belongs to the server's event loop: made here, not at import.
        app.state.llm = TritonLLM(triton_url, model_repository, admin_headers=admin_headers, tls=triton_tls)
        yield
        await app.state.llm.close()

    app = FastAPI(title="paged_llm OpenAI-compatible API", lifespan=lifespan)
    app.state.chat = ChatTemplates(chat_template)
    app.state.max_request_body_bytes = max_request_body_bytes
    app.state.request_log = request_log or RequestLog()

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

    @app.middleware("http")
    async def _authenticate(request: Request, call_next):
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
    metrics.register(app)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await read_json(request, app.state.max_request_body_bytes))
        served = await app.state.llm.model(req.model)
        embeddings.check_generates(served)
        served.check_n(req.n)
        sampling = req.sampling_parameters(req.max_tokens)
        if req.logprobs is not None:
            sampling["logprobs"] = req.logprobs
        gen = app.state.llm.generate(req.model, req.prompt, sampling, req.stream, req.logprobs is not None)
        shape = Completion(req)
        app.state.request_log.received(shape.id, req.model, req.prompt, sampling)
        return await _respond(request, gen, req, shape)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(ChatCompletionRequest, await read_json(request, app.state.max_request_body_bytes))
        served = await app.state.llm.model(req.model)
        embeddings.check_generates(served)
        served.check_n(req.n)
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in req.messages]
        ids = await asyncio.to_thread(app.state.chat.prompt_ids, served.checkpoint, req.model, messages)
        sampling = req.sampling_parameters(req.max_completion_tokens or req.max_tokens)
        sampling.setdefault("max_tokens", None)          # OpenAI's default: up to the context length
        if req.logprobs:
            sampling["logprobs"] = req.top_logprobs or 0
        gen = app.state.llm.generate(req.model, ids, sampling, req.stream, req.logprobs)
        shape = ChatCompletion(req)
        app.state.request_log.received(shape.id, req.model, messages, sampling)
        return await _respond(request, gen, req, shape)

    return app


def _model_card(m) -> dict:
    return {"id": m.name, "object": "model", "created": m.created, "owned_by": "paged_llm", "root": m.triton_model,
            "parent": m.parent}


async def _respond(request: Request, gen: Generation, req, shape: "Shape"):
    deltas = gen.__aiter__()
    if req.stream:
        # Wait for the first response (or error) before answering 200: a bad request is
        # a proper 400, not an event inside a stream that already said OK.
        try:
            first: Optional[Delta] = await deltas.__anext__()
        except StopAsyncIteration:
            first = None
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_events(gen, deltas, first, shape, usage, request.app.state.request_log),
                                 media_type="text/event-stream")
    watcher = asyncio.create_task(_cancel_on_disconnect(request, gen))
    try:
        async for delta in deltas:
            shape.add(delta)
    finally:
        watcher.cancel()
        request.app.state.request_log.finished(shape.id, shape.texts, shape.finish)
    return shape.whole()


async def _cancel_on_disconnect(request: Request, gen: Generation) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.2)
    gen.cancel()


async def _events(gen: Generation, deltas, first: Optional[Delta], shape: "Shape",
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
    except APIError as e:       # after the 200: the error as an event, as OpenAI does
        yield f"data: {json.dumps(error_body(e.status, e.message, e.param))}\n\n"
    finally:
        gen.cancel()            # the client left, or the request is over: end it in Triton
        request_log.finished(shape.id, shape.texts, shape.finish)


def _sse(chunk: dict, include_usage: bool) -> str:
    if include_usage:
        chunk = {**chunk, "usage": None}
    return f"data: {json.dumps(chunk)}\n\n"


class Shape:
    """Accumulates one completion's deltas and writes the OpenAI objects."""
    object_name = chunk_name = ""

    def __init__(self, req) -> None:
        self.req = req
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.texts = [""] * req.n
        self.token_logprobs: list[list] = [[] for _ in range(req.n)]
        self.finish: list[Optional[str]] = [None] * req.n
        self.prompt_tokens = 0
        self.completion_tokens = [0] * req.n

    def base(self, chunk: bool = True) -> dict:
        return {"id": self.id, "object": self.chunk_name if chunk else self.object_name, "created": self.created,
                "model": self.req.model}

    def add(self, d: Delta) -> None:
        self.texts[d.index] += d.text
        self.token_logprobs[d.index] += list(zip(d.token_ids, d.logprobs))
        if d.finish_reason is not None:
            self.finish[d.index] = FINISH.get(d.finish_reason, d.finish_reason)
        self.prompt_tokens = d.num_input_tokens
        self.completion_tokens[d.index] += len(d.token_ids)     # a stream's responses carry deltas

    def usage(self) -> dict:
        done = sum(self.completion_tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}

    def opening(self) -> list[dict]:
        return []


def _top(entry: dict, k: int) -> list[tuple[str, float]]:
    """The k most likely tokens of one position: (decoded text, logprob), by rank."""
    ranked = sorted(entry.values(), key=lambda lp: lp["rank"])
    return [(lp["decoded_token"] or "", _json_logprob(lp["logprob"])) for lp in ranked[:k]]


def _json_logprob(value: float) -> float:
    """JSON has no -inf: vLLM's OpenAI server sends -9999.0 for a token of probability 0."""
    return value if value > -9999.0 else -9999.0


class Completion(Shape):
    prefix, object_name, chunk_name = "cmpl", "text_completion", "text_completion"

    def _logprobs(self, pairs: list, offset: int) -> Optional[dict]:
        if self.req.logprobs is None:
            return None
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in pairs:
            chosen = entry[str(token_id)]
            out["tokens"].append(chosen["decoded_token"] or "")
            out["token_logprobs"].append(_json_logprob(chosen["logprob"]))
            out["top_logprobs"].append(dict(_top(entry, self.req.logprobs)))
            out["text_offset"].append(offset)
            offset += len(chosen["decoded_token"] or "")
        return out

    def chunk(self, d: Delta) -> dict:
        offset = len(self.texts[d.index]) - len(d.text)
        return {**self.base(), "choices": [{"index": d.index, "text": d.text, "finish_reason": self.finish[d.index],
                                            "logprobs": self._logprobs(list(zip(d.token_ids, d.logprobs)), offset)}]}

    def whole(self) -> dict:
        return {**self.base(chunk=False), "usage": self.usage(), "choices": [
            {"index": i, "text": self.texts[i], "finish_reason": self.finish[i],
             "logprobs": self._logprobs(self.token_logprobs[i], 0)} for i in range(self.req.n)]}


class ChatCompletion(Shape):
    prefix, object_name, chunk_name = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def _logprobs(self, pairs: list) -> Optional[dict]:
        if not self.req.logprobs:
            return None
        k = self.req.top_logprobs or 0

        def item(text: str, lp: float) -> dict:
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}
        content = []
        for token_id, entry in pairs:
            chosen = entry[str(token_id)]
            content.append({**item(chosen["decoded_token"] or "", _json_logprob(chosen["logprob"])),
                            "top_logprobs": [item(t, lp) for t, lp in _top(entry, k)]})
        return {"content": content}

    def opening(self) -> list[dict]:
        return [{**self.base(), "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None} for i in range(self.req.n)]}]

    def chunk(self, d: Delta) -> dict:
        return {**self.base(), "choices": [{"index": d.index, "delta": {"content": d.text} if d.text else {},
                                            "logprobs": self._logprobs(list(zip(d.token_ids, d.logprobs))),
                                            "finish_reason": self.finish[d.index]}]}

    def whole(self) -> dict:
        return {**self.base(chunk=False), "usage": self.usage(), "choices": [
            {"index": i, "message": {"role": "assistant", "content": self.texts[i]},
             "logprobs": self._logprobs(self.token_logprobs[i]), "finish_reason": self.finish[i]}
            for i in range(self.req.n)]}
