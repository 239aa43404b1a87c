"""The frontend's OpenAPI document (`/openapi.json`), as the routes really behave.

The routes parse their bodies themselves (protocol.py: a 400 naming the field, OpenAI's
shape, never FastAPI's 422), so FastAPI sees no body and no response model: both are
declared here. Request bodies are the JSON schemas of the pydantic models the routes
parse with; responses are the objects below, the event stream of `stream: true` (one
schema per event: a chunk, an error after the 200, or `[DONE]`) and every error status
a route answers with, each in the error shape of errors.py. tests/integration/
test_api_fuzz.py holds the running server to this document with schemathesis.
"""

from __future__ import annotations

import copy
from typing import Any, Literal, Optional

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from frontend.openai_api.auth import protected
from frontend.openai_api.embeddings import EmbeddingRequest, EmbeddingResponse
from frontend.openai_api.errors import TYPES
from frontend.openai_api.lora_adapters import ADMIN_ROUTES as LORA_ROUTES
from frontend.openai_api.lora_adapters import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from frontend.openai_api.sleep_routes import ROUTES as SLEEP_ROUTES

# Routes that answer 401 without the admin key, API keys or not.
ADMIN_ROUTES = LORA_ROUTES + SLEEP_ROUTES
from frontend.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from frontend.openai_api.responses_protocol import ResponsesRequest
from frontend.openai_api.responses_schemas import Response, ResponseEvent
from frontend.openai_api.tokenization import (DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest,
                                              TokenizeCompletionRequest, TokenizeResponse)

FinishReason = Literal["stop", "length", "tool_calls", "function_call"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str]
    code: int


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[Optional[float]]               # null: an echoed prompt's first token
    top_logprobs: list[Optional[dict[str, float]]]      # the chosen token and the `logprobs` most likely
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int = Field(ge=1)
    decoded_token: Optional[str]


class CompletionChoice(BaseModel):
    index: int = Field(ge=0)
    text: str
    finish_reason: FinishReason
    logprobs: Optional[CompletionLogprobs]
    # With the request's prompt_logprobs (vLLM's): per prompt token {token id: entry}, null first.
    prompt_logprobs: Optional[list[Optional[dict[str, PromptLogprob]]]] = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice] = Field(min_length=1)
    usage: Usage


class CompletionChunkChoice(CompletionChoice):
    finish_reason: Optional[FinishReason]      # null until the sequence's last chunk


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]       # empty in the usage chunk
    usage: Optional[Usage] = None              # with stream_options.include_usage: null, then the totals


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str                              # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"]
    content: Optional[str]                      # null: only calls, or it never stopped reasoning
    reasoning_content: Optional[str] = None     # with --reasoning-parser (also as `reasoning`)
    reasoning: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    function_call: Optional[FunctionCall] = None   # when the request sent `functions`


class ChatChoice(BaseModel):
    index: int = Field(ge=0)
    message: ChatCompletionMessage
    logprobs: Optional[ChatLogprobs]
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice] = Field(min_length=1)
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: Optional[str] = None                  # in a call's first delta
    arguments: Optional[str] = None             # pieces that concatenate to the arguments


class ToolCallDelta(BaseModel):
    index: int = Field(ge=0)
    id: Optional[str] = None                    # in a call's first delta, with its name
    type: Optional[Literal["function"]] = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Optional[Literal["assistant"]] = None      # in the first chunk only
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: Optional[list[ToolCallDelta]] = None
    function_call: Optional[FunctionCallDelta] = None


class ChatChunkChoice(BaseModel):
    index: int = Field(ge=0)
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs]
    finish_reason: Optional[FinishReason]


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str                                   # the Triton model that serves it
    parent: Optional[str]                       # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]


REQUESTS = (CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeCompletionRequest,
            TokenizeChatRequest, DetokenizeRequest, EmbeddingRequest, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest)
RESPONSES = (ErrorResponse, Completion, CompletionChunk, ChatCompletion, ChatCompletionChunk, ModelList, Model, Health,
             Response, ResponseEvent, TokenizeResponse, DetokenizeResponse, EmbeddingResponse)


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(name: str) -> dict:
    return {"application/json": {"schema": _ref(name)}}


def _events(chunk: str) -> dict:
    """One server-sent event of a stream: `data:` a chunk, an error (after the 200), or the
    closing `[DONE]`. `itemSchema` is OpenAPI 3.2's per-event schema."""
    payload = {"type": "string", "contentMediaType": "application/json",
               "contentSchema": {"anyOf": [_ref(chunk), _ref("ErrorResponse")]}}
    return {"itemSchema": {"type": "object", "required": ["data"], "properties": {
        "data": {"if": {"const": "[DONE]"}, "else": payload}}}}


ERRORS = {400: "A bad request: the message names the field (`param`) when there is one",
          401: "No or a wrong API key (`Authorization: Bearer <key>`)",
          403: "The frontend holds no key that allows this change, or not the model's admin key",
          404: "Unknown model (or stored response)",
          413: "The body is larger than the frontend's max_request_body_bytes",
          500: "The engine failed on this request",
          503: "Triton is unavailable, the model out of service or its queue full",
          504: "The request passed its deadline (request_timeout_s) and was aborted"}


def _error(status: int) -> dict:
    """The error shape, with `code` and `type` fixed for the status."""
    fixed = {"properties": {"error": {"properties": {"code": {"const": status}, "type": {"const": TYPES[status]}}}}}
    response = {"description": ERRORS[status],
                "content": {"application/json": {"schema": {"allOf": [_ref("ErrorResponse"), fixed]}}}}
    if status == 401:
        response["headers"] = {"WWW-Authenticate": {"required": True, "schema": {"const": "Bearer"}}}
    return response


def _admin_error() -> dict:
    """401 for a missing or wrong `admin-key` header (sleep mode, LoRA without API keys)."""
    fixed = {"properties": {"error": {"properties": {"code": {"const": 401}, "type": {"const": TYPES[401]}}}}}
    return {"description": "No or a wrong `admin-key` header (Triton's admin key)",
            "content": {"application/json": {"schema": {"allOf": [_ref("ErrorResponse"), fixed]}}}}


def _generation(request: str, response: str, chunk: str, summary: str) -> dict:
    return {"summary": summary,
            "requestBody": {"required": True, "content": _json(request)},
            "responses": {"200": {"description": f"The {response} object, or with `stream: true` its chunks as "
                                                 "server-sent events ending in `data: [DONE]`",
                                  "content": {**_json(response), "text/event-stream": _events(chunk)}},
                          **{str(s): _error(s) for s in (400, 401, 404, 413, 500, 503, 504)}}}


OPERATIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("/health", "get"): {"summary": "Whether tritonserver is ready", "responses": {
        "200": {"description": "Ready", "content": _json("Health")},
        "503": {"description": "Not ready", "content": _json("Health")}}},
    ("/health/ready", "get"): {"summary": "The same as /health (Triton's OpenAI frontend's name)", "responses": {
        "200": {"description": "Ready", "content": _json("Health")},
        "503": {"description": "Not ready", "content": _json("Health")}}},
    ("/v1/models", "get"): {"summary": "The models served: Triton models of our backend and their LoRA adapters",
                            "responses": {"200": {"description": "The models", "content": _json("ModelList")},
                                          **{str(s): _error(s) for s in (401, 503)}}},
    ("/v1/models/{model_id}", "get"): {"summary": "One served model (`client.models.retrieve`)", "responses": {
        "200": {"description": "The model", "content": _json("Model")},
        **{str(s): _error(s) for s in (401, 404, 503)}}},
    ("/v1/embeddings", "post"): {
        "summary": "Embeddings of one or more inputs, from a model built with --runner pooling",
        "requestBody": {"required": True, "content": _json("EmbeddingRequest")},
        "responses": {"200": {"description": "The vectors (floats, or base64 of float32 bytes), in input order",
                              "content": _json("EmbeddingResponse")},
                      **{str(s): _error(s) for s in (400, 401, 404, 413, 500, 503, 504)}}},
    ("/tokenize", "post"): {
        "summary": "A prompt's (or chat's, with the chat template) token ids, as vLLM's /tokenize",
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "anyOf": [_ref("TokenizeCompletionRequest"), _ref("TokenizeChatRequest")]}}}},
        "responses": {"200": {"description": "The token ids", "content": _json("TokenizeResponse")},
                      **{str(s): _error(s) for s in (400, 401, 404, 413, 503)}}},
    ("/detokenize", "post"): {
        "summary": "Token ids back to text, as vLLM's /detokenize",
        "requestBody": {"required": True, "content": _json("DetokenizeRequest")},
        "responses": {"200": {"description": "The text", "content": _json("DetokenizeResponse")},
                      **{str(s): _error(s) for s in (400, 401, 404, 413, 503)}}},
    ("/metrics", "get"): {"summary": "The frontend's HTTP metrics (Prometheus text): requests and latencies by "
                                     "route, method and status", "responses": {
        "200": {"description": "Prometheus text format",
                "content": {"text/plain": {"schema": {"type": "string"}}}}}},
    ("/v1/completions", "post"): _generation("CompletionRequest", "Completion", "CompletionChunk",
                                             "A completion of a prompt (text or token ids)"),
    ("/v1/chat/completions", "post"): _generation("ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk",
                                                  "A chat completion, with the model's chat template"),
    ("/v1/responses", "post"): _generation("ResponsesRequest", "Response", "ResponseEvent",
                                           "A response (OpenAI's Responses API), on the chat path"),
    ("/v1/load_lora_adapter", "post"): {
        "summary": "Serve a PEFT LoRA adapter from a folder on the server under a new name (vLLM's route); "
                   "without API keys it takes the header `admin-key`",
        "requestBody": {"required": True, "content": _json("LoadLoRAAdapterRequest")},
        "responses": {"200": {"description": "Success: the adapter serves as a model of its name",
                              "content": {"text/plain": {"schema": {"type": "string"}}}},
                      **{str(s): _error(s) for s in (400, 401, 403, 404, 413, 500, 503)}}},
    ("/v1/unload_lora_adapter", "post"): {
        "summary": "Stop serving an adapter (vLLM's route): new requests for it are refused at once, and it is "
                   "dropped when its running requests finish",
        "requestBody": {"required": True, "content": _json("UnloadLoRAAdapterRequest")},
        "responses": {"200": {"description": "Success", "content": {"text/plain": {"schema": {"type": "string"}}}},
                      **{str(s): _error(s) for s in (400, 401, 403, 404, 413, 500, 503)}}},
    ("/sleep", "post"): {
        "summary": "vLLM's sleep mode: level 1 frees the KV cache (on CUDA the weights go to host memory), level 2 "
                   "the weights too. Needs the header `admin-key`; a model serving requests refuses (400)",
        "parameters": [{"name": "level", "in": "query", "required": False, "schema": {"type": "string"}},
                       {"name": "model", "in": "query", "required": False, "schema": {"type": "string"}}],
        "responses": {"200": {"description": "Asleep"}, **{str(s): _error(s) for s in (400, 401, 403, 404, 503)}}},
    ("/wake_up", "post"): {
        "summary": "Wake the engine up (level 2 reads the weights again). Needs the header `admin-key`",
        "parameters": [{"name": "model", "in": "query", "required": False, "schema": {"type": "string"}}],
        "responses": {"200": {"description": "Awake"}, **{str(s): _error(s) for s in (400, 401, 403, 404, 503)}}},
    ("/is_sleeping", "get"): {
        "summary": "Whether a model is asleep. Needs the header `admin-key`",
        "parameters": [{"name": "model", "in": "query", "required": False, "schema": {"type": "string"}}],
        "responses": {"200": {"description": "The state", "content": {"application/json": {"schema": {
            "type": "object", "required": ["is_sleeping"], "properties": {"is_sleeping": {"type": "boolean"}}}}}},
            **{str(s): _error(s) for s in (401, 403, 404, 503)}}},
    ("/v1/responses/{response_id}", "get"): {
        "summary": "A stored response (`store`, the default)",
        "parameters": [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}],
        "responses": {"200": {"description": "The response", "content": _json("Response")},
                      **{str(s): _error(s) for s in (400, 401, 404)}}},
}


_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _standard_bounds(schema: Any) -> Any:
    """JSON Schema's names for bounds. pydantic writes `ge`/`le` where a Field's bound sits
    on an Optional of an Annotated int with a validator (protocol.Int): validation keeps
    the bound, the document would lose it."""
    if isinstance(schema, list):
        return [_standard_bounds(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    typed = schema.get("type") in ("integer", "number")
    return {(_BOUNDS[k] if typed and k in _BOUNDS else k): _standard_bounds(v) for k, v in schema.items()}


def openapi(app: FastAPI, api_keys: bool) -> dict:
    """The document, built once. api_keys: the /v1 routes need `Authorization: Bearer`."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, description=__doc__.split("\n\n")[0],
                          routes=app.routes)
        _, defs = models_json_schema([(m, "validation") for m in REQUESTS] + [(m, "serialization") for m in RESPONSES],
                                     ref_template="#/components/schemas/{model}")
        doc.setdefault("components", {})["schemas"] = _standard_bounds(defs["$defs"])
        if api_keys:
            doc["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
        for path, item in doc["paths"].items():
            for method, operation in item.items():
                if (path, method) not in OPERATIONS:
                    raise RuntimeError(f"{method.upper()} {path} is not documented in frontend/openai_api/schemas.py")
                operation.update(copy.deepcopy(OPERATIONS[path, method]))
                if api_keys and protected(path):
                    operation["security"] = [{"apiKey": []}]
                elif path not in ADMIN_ROUTES:
                    operation["responses"].pop("401", None)
                else:                   # the admin-key header's 401: no WWW-Authenticate
                    operation["responses"]["401"] = _admin_error()
        app.openapi_schema = doc
    return app.openapi_schema
