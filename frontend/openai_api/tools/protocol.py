"""The request fields of tool calling (chat's `tools`, `tool_choice`, `functions`, an
assistant turn's `tool_calls`), validated once; the Responses API reuses FunctionDefinition."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from frontend.openai_api.nulls import NullMeansDefault


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None     # a JSON schema
    strict: Optional[bool] = None


class ChatTool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(BaseModel):
    name: str
    arguments: str                                  # JSON text, as OpenAI sends it


class MessageToolCall(NullMeansDefault):
    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction
