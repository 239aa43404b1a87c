"""`POST /v1/embeddings` (OpenAI's, as vLLM serves it) for embedding models: Triton
models whose config says `runner: pooling` (builder build --runner pooling). Each input
is one Triton request whose result is the `embedding` output (backend/engine/
pooling_runner.py: the pooled final hidden state, L2-normalized by default); the inputs
of a request run concurrently, so the engine batches them.

`input`: a string, a list of strings, a list of token ids or a list of such lists (at
most MAX_INPUTS). `encoding_format`: float (lists of numbers) or base64 (the float32
little-endian bytes, what the official client asks for by default). `dimensions` is a
400: the models served have no Matryoshka training that would make a shorter vector
meaningful (vLLM refuses it the same way). A generative model gets a 400 here, and an
embedding model a 400 on the completion routes.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Literal, Optional, Union

import numpy as np
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator
from tritonclient.grpc import InferRequestedOutput
from tritonclient.utils import InferenceServerException

from frontend.triton_inputs import make_inputs
from frontend.openai_api.errors import APIError, from_triton
from frontend.openai_api.nulls import NullMeansDefault
from frontend.openai_api.protocol import TokenId
from frontend.openai_api.request_body import read_request
from frontend.openai_api.triton_client import ServedModel, stream_end

MAX_INPUTS = 2048          # OpenAI's bound on inputs per request

_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}, "minItems": 1}
_INPUT = {"anyOf": [{"type": "string", "minLength": 1},
                    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
                     "maxItems": MAX_INPUTS},
                    _TOKEN_IDS, {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": MAX_INPUTS}]}


class EmbeddingRequest(NullMeansDefault):
    """(A null `encoding_format` is "float", as OpenAI's: openai-python sends an argument
    passed as None as null.)"""
    model_config = ConfigDict(extra="ignore")
    model: str
    input: Union[str, list[str], list[TokenId], list[list[TokenId]]] = Field(json_schema_extra=_INPUT)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, json_schema_extra={"type": "null"})
    user: Optional[str] = None                      # accepted, unused

    @field_validator("input")
    @classmethod
    def _inputs(cls, v):
        items = v if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]
        if not items or len(items) > MAX_INPUTS:
            raise ValueError(f"between 1 and {MAX_INPUTS} inputs")
        if any(len(item) == 0 for item in items):
            raise ValueError("an input is empty")
        return v

    @field_validator("dimensions")
    @classmethod
    def _dimensions(cls, v):
        if v is not None:
            raise ValueError("not supported: the served embedding models have one output size")
        return v

    def prompts(self) -> list[Union[str, list[int]]]:
        v = self.input
        return list(v) if isinstance(v, list) and isinstance(v[0], (str, list)) else [v]


class EmbeddingData(BaseModel):
    object: Literal["embedding"]
    index: int = Field(ge=0)
    embedding: Union[list[float], str]


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[EmbeddingData] = Field(min_length=1)
    usage: EmbeddingUsage


def check_generates(served: ServedModel) -> None:
    """The completion routes' check: an embedding model generates nothing."""
    if served.runner == "pooling":
        raise APIError(400, f"model '{served.name}' is an embedding model: use /v1/embeddings", "model")


async def _embed_one(client, model: str, prompt: Union[str, list[int]]) -> tuple[np.ndarray, int]:
    """One input through Triton: (its vector, its token count)."""
    inputs = make_inputs(prompt if isinstance(prompt, str) else None, None, False,
                         input_ids=None if isinstance(prompt, str) else list(prompt),
                         extra={"return_num_input_tokens": np.array([True])})
    request = {"model_name": model, "inputs": inputs, "request_id": uuid.uuid4().hex,
               "outputs": [InferRequestedOutput("embedding"), InferRequestedOutput("num_input_tokens")],
               "parameters": {"triton_enable_empty_final_response": True}}

    async def requests():
        yield request
    call = client.stream_infer(requests())
    failure: Optional[APIError] = None
    vector, tokens = None, 0
    try:
        async for result, error in call:
            if error is not None:               # read on to FINAL, as Generation does
                failure = failure or from_triton(str(error.message() if hasattr(error, "message") else error))
                continue
            if failure is None and result.as_numpy("embedding") is not None:
                vector = result.as_numpy("embedding").astype(np.float32).reshape(-1)
                tokens = int(result.as_numpy("num_input_tokens").reshape(-1)[0])
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                await stream_end(call)          # not cancelled at once: triton_client.stream_end
                break
    except InferenceServerException as e:
        raise from_triton(e.message() or str(e)) from None
    finally:
        call.cancel()                           # a stream left open keeps Triton from unloading the model
    if failure is not None:
        raise failure
    if vector is None:
        raise APIError(500, f"model '{model}' returned no embedding")
    return vector, tokens


def _encode(vector: np.ndarray, encoding_format: str) -> Union[list[float], str]:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def register(app: FastAPI) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict:
        req = await read_request(request, EmbeddingRequest, app.state.max_request_body_bytes)
        served = await app.state.llm.model(req.model)
        if served.runner != "pooling":
            raise APIError(400, f"model '{req.model}' is not an embedding model (it generates text: use "
                                "/v1/completions or /v1/chat/completions); /v1/embeddings needs a model built "
                                "with --runner pooling", "model")
        if app.state.llm.health is not None:
            app.state.llm.health.check()            # 503 at once while the backend cannot serve
        client = app.state.llm.client
        # Concurrent, so the engine batches them; the first failure cancels the others
        # (gather, not asyncio.TaskGroup: the project runs on Python 3.10 too).
        tasks = [asyncio.ensure_future(_embed_one(client, served.triton_model, p)) for p in req.prompts()]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)    # each one's cancellation done
            raise
        tokens = sum(n for _, n in results)
        return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": req.model,
                "data": [{"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
                         for i, (v, _) in enumerate(results)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
