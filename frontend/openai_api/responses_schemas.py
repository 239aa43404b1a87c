"""The Responses API's reply objects as /openapi.json declares them (schemas.py): the
response, its output items (message, reasoning, function_call) and its streamed events."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any] = []


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"]
    text: str


class ResponseMessage(BaseModel):
    type: Literal["message"]
    id: str
    role: Literal["assistant"]
    status: ItemStatus
    content: list[OutputText]


class ResponseReasoning(BaseModel):
    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    status: ItemStatus
    content: list[ReasoningText]


class ResponseFunctionCall(BaseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str                              # JSON text
    status: ItemStatus


class ResponseUsage(BaseModel):
    input_tokens: int = Field(ge=0)
    input_tokens_details: dict[str, int]
    output_tokens: int = Field(ge=0)
    output_tokens_details: dict[str, int]
    total_tokens: int = Field(ge=0)


class Response(BaseModel):
    id: str
    object: Literal["response"]
    created_at: int
    status: ItemStatus
    model: str
    output: list[Union[ResponseMessage, ResponseReasoning, ResponseFunctionCall]]
    error: None
    incomplete_details: Optional[dict[str, str]]
    usage: ResponseUsage
    previous_response_id: Optional[str]
    store: bool


class ResponseEvent(BaseModel):
    """One streamed event: `type` names it (response.created, response.output_text.delta,
    ..., response.completed or response.incomplete; `error` after the 200)."""
    type: str
    sequence_number: int = Field(ge=0)
