"""The Responses API's request (`POST /v1/responses`), validated once, and its input
items -> the chat messages our templates render.

Input items: messages (text parts), `function_call` (a call the model made) and
`function_call_output` (its result); `reasoning` items are dropped (a template does not
take them back), as vLLM does. Tools are function tools. `text.format` is structured output.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from frontend.openai_api.errors import APIError
from frontend.openai_api.nulls import NullMeansDefault
from frontend.openai_api.protocol import INT32_MAX, ChatMessage, at_most_messages
from frontend.openai_api.tools.protocol import FunctionDefinition

TEXT_PARTS = ("input_text", "output_text", "text")


class FunctionTool(FunctionDefinition):
    type: Literal["function"]


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: Optional[TextFormat] = None


class ResponsesRequest(NullMeansDefault):
    model_config = ConfigDict(extra="ignore")

    model: str
    input: Annotated[Union[str, list[dict[str, Any]]], BeforeValidator(lambda v: at_most_messages(v, "input"))]
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[None, Literal["none", "auto", "required"], NamedFunction] = None
    parallel_tool_calls: bool = True
    text: Optional[TextConfig] = None
    max_output_tokens: Optional[int] = Field(None, ge=1, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    previous_response_id: Optional[str] = None
    store: bool = True
    metadata: Optional[dict[str, str]] = None
    reasoning: Optional[dict[str, Any]] = None      # {"effort": ...}: accepted; the template decides
    user: Optional[str] = None
    truncation: Literal["disabled", "auto"] = "disabled"
    # vLLM's extras, as in chat
    top_k: int = Field(-1, ge=-1, le=INT32_MAX)
    seed: Optional[int] = Field(None, ge=-2**63, le=2**63 - 1)
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _tools(self) -> "ResponsesRequest":
        for tool in self.tools or []:
            if tool.get("type") != "function":
                raise ValueError(f"tools of type {tool.get('type')!r} are not supported: only 'function'")
            FunctionTool.model_validate(tool)
        return self

    def chat_tools(self) -> tuple[Optional[list[dict]], Any]:
        """tools and tool_choice in the chat form (tools/choice.py plans them)."""
        tools = [{"type": "function", "function": FunctionTool.model_validate(t).model_dump(
            exclude_none=True, exclude={"type"})} for t in self.tools] if self.tools else None
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            choice = {"type": "function", "function": {"name": choice.name}}
        return tools, choice

    def sampling_parameters(self) -> dict[str, Any]:
        p: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                             "max_tokens": self.max_output_tokens}
        if self.seed is not None:
            p["seed"] = self.seed
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_object":
            p["guided_json_object"] = True
        elif fmt is not None and fmt.type == "json_schema":
            if not isinstance(fmt.schema_, dict):
                raise APIError(400, "text.format.schema must be a JSON schema object", "text.format.schema")
            p["guided_json"] = fmt.schema_
        return p


def _text(content: Any, where: str, images: bool = False) -> Union[str, list[dict]]:
    """The content as chat content: its text, or with images (`input_image`, where
    `images`) chat's text and image_url parts in order."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(400, f"'{where}.content' must be a string or a list of parts", where)
    parts: list[dict] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if images and kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
            continue
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            takes = "input_text / output_text" + (" / input_image" if images else "")
            raise APIError(400, f"'{where}.content': parts of type {kind!r} are not supported (this model "
                                f"takes {takes})", where)
        parts.append({"type": "text", "text": part["text"]})
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def input_messages(items: Union[str, list[dict[str, Any]]]) -> list[dict]:
    """The input as chat messages (calls the model made become an assistant turn's
    tool_calls; their results, tool turns)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise APIError(400, f"'{where}' must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"'{where}.role' must be user, system, developer or assistant", where)
            messages.append({"role": role, "content": _text(item.get("content"), where, images=role == "user")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise APIError(400, f"'{where}': a function_call needs call_id, name and arguments (strings)", where)
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"'{where}': a function_call_output needs its call_id", where)
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output"), where)})
        elif kind != "reasoning":
            raise APIError(400, f"'{where}': input items of type {kind!r} are not supported", where)
    return messages


def for_template(messages: list[dict]) -> tuple[list[dict], list[str]]:
    """Through the chat API's message model: the same checks and the same template form;
    with the image URLs of the conversation, in order."""
    checked = [ChatMessage.model_validate(m) for m in messages]
    return [m.for_template() for m in checked], [u for m in checked for u in m.image_urls()]
