"""`POST /tokenize` and `POST /detokenize` in vLLM's shapes, with the served model's own
tokenizer and chat template (the ones chat completions use), so a client can count a
prompt's tokens exactly as the engine will see them.

/tokenize takes a text `prompt` (special tokens such as BOS added unless
`add_special_tokens: false`) or chat `messages` rendered with the chat template
(`add_generation_prompt`, `continue_final_message`; the template's own special tokens,
so `add_special_tokens` defaults to false there). It answers `{count, max_model_len,
tokens}` (and `token_strs` with `return_token_strs`). /detokenize takes `tokens` and
answers `{prompt}`. Both sit beside /v1 as in vLLM; unlike vLLM they need the API key
when keys are set (auth.py): tokenizing is work a stranger should not get for free.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional, Union

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from backend.engine.errors import InvalidRequestError
from backend.engine.prompt_length import tokenize_within
from frontend.openai_api.errors import APIError
from frontend.openai_api.protocol import Messages, TokenId, parse
from frontend.openai_api.request_body import read_json, read_request
from frontend.openai_api.triton_client import ServedModel


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # vLLM's: optional, the first served model when left out.
    model: Optional[str] = None


class TokenizeCompletionRequest(_Base):
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Base):
    messages: Messages = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _one_ending(self) -> "TokenizeChatRequest":
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true (set "
                             "add_generation_prompt to false to continue the final message)")
        return self


TokenizeRequest = Union[TokenizeCompletionRequest, TokenizeChatRequest]


class DetokenizeRequest(_Base):
    tokens: list[TokenId]


class TokenizeResponse(BaseModel):
    count: int = Field(ge=0)
    max_model_len: int = Field(ge=0)       # 0: unknown (neither the config nor the checkpoint says)
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeResponse(BaseModel):
    prompt: str


async def _served(app: FastAPI, name: Optional[str]) -> ServedModel:
    if name is not None:
        return await app.state.llm.model(name)
    models = await app.state.llm.models()
    if not models:
        raise APIError(503, "no model is ready")
    return next(iter(models.values()))


def _tokenizer(app: FastAPI, served: ServedModel):
    return app.state.chat.tokenizer(served.checkpoint, served.name, "tokenizing")


def tokenize_or_400(tokenize: Callable[[str], list[int]], text: str, max_model_len: Optional[int],
                    param: str) -> list[int]:
    """`tokenize(text)`, or a 400 naming `param` once the text is known not to fit
    max_model_len (when known), after about that many tokens of it (prompt_length.py)."""
    if not max_model_len:
        return tokenize(text)
    try:
        return tokenize_within(tokenize, text, max_model_len)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param) from None


def tokenize_ids(app: FastAPI, served: ServedModel, req: TokenizeRequest) -> list[int]:
    """A prompt that generation would refuse for its length (max_model_len, with room
    for one generated token) is a 400 once that is known, after tokenizing about that many
    tokens of it (prompt_length.py): a 16 MB prompt was tokenized whole (22 s of the
    frontend's CPU, 8.1M ids)."""
    if isinstance(req, TokenizeCompletionRequest):
        tok = _tokenizer(app, served)
        return tokenize_or_400(lambda t: tok(t, add_special_tokens=req.add_special_tokens)["input_ids"], req.prompt,
                               served.max_model_len, "prompt")
    # Rendered as chat renders it (chat.py), with /tokenize's switches.
    return app.state.chat.render(served.checkpoint, served.name, [m.for_template() for m in req.messages],
                                 max_model_len=served.max_model_len or None, template_kwargs=req.chat_template_kwargs,
                                 add_generation_prompt=req.add_generation_prompt,
                                 continue_final_message=req.continue_final_message,
                                 add_special_tokens=req.add_special_tokens)[1]


def register(app: FastAPI) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await read_json(request, app.state.max_request_body_bytes)
        cls = TokenizeChatRequest if isinstance(body, dict) and "messages" in body else TokenizeCompletionRequest
        req = await asyncio.to_thread(parse, cls, body)     # validated off the event loop
        served = await _served(app, req.model)
        ids = await asyncio.to_thread(tokenize_ids, app, served, req)
        out = TokenizeResponse(count=len(ids), max_model_len=served.max_model_len or 0, tokens=ids)
        if req.return_token_strs:
            out.token_strs = _tokenizer(app, served).convert_ids_to_tokens(ids)
        return out.model_dump(exclude_none=True)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = await read_request(request, DetokenizeRequest, app.state.max_request_body_bytes)
        served = await _served(app, req.model)
        tok = _tokenizer(app, served)
        bad = next((t for t in req.tokens if t >= len(tok)), None)
        if bad is not None:
            raise APIError(400, f"invalid 'tokens': token id {bad} is outside the vocabulary [0, {len(tok)})",
                           "tokens")
        return {"prompt": await asyncio.to_thread(tok.decode, req.tokens)}
