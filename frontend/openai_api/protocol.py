"""The OpenAI request bodies we accept, validated once (pydantic), and their translation
into our Triton contract's `sampling_parameters` (vLLM's names).

Unknown fields are ignored, as OpenAI's own API does for fields it does not know; wrong
types and values are a 400 naming the field. Types are strict (pydantic's strict mode):
"10" is not a number and "yes" not a boolean, though an integer is a valid float and 10.0
a valid integer (JSON has one number type). An explicit null for an optional field means
"not given", its default (nulls.py: what OpenAI, vLLM and the openai client do); a
required field's null is a 400 naming it. Counts are at most INT32's. Message roles are
OpenAI's (system, developer, user, assistant, tool); only an assistant message may have null content; content parts are text (images and
audio get a 400 saying this model does not take them: chat_content.py). vLLM's extras (top_k,
repetition_penalty, min_tokens, ignore_eos, bad_words, guided_*) are accepted as `vllm serve` does,
and so is each logits processor's parameter (min_p, ...: backend/engine/logits_processors),
with the engine's own field definition.
The body must be strict JSON (request_body.py). /openapi.json declares these models' JSON
schemas (schemas.py); where a validator narrows a field, so does its declared schema.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model, field_validator,
                      model_validator)

from backend.engine.sampling.logits_processors import PROCESSORS, request_fields
from frontend.openai_api.chat_content import check_parts, image_url_of
from frontend.openai_api.errors import APIError
from frontend.openai_api.nulls import NullMeansDefault
from frontend.openai_api.tools.protocol import (ChatTool, FunctionDefinition, FunctionName, MessageToolCall,
                                                NamedToolChoice)


# No coercion ("10" -> 10, "yes" -> True): a client sending strings has a bug to hear about.
STRICT = ConfigDict(strict=True)


def _integral(value: Any) -> Any:
    # JSON has one number type: 10.0 is the integer 10 (so JSON Schema's "integer" says);
    # 10.5, "10" and true are not.
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]


class StreamOptions(NullMeansDefault):
    model_config = STRICT
    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[dict[str, Any]] = None


# The declared schemas (/openapi.json, schemas.py) of fields whose validators (here or the
# engine's SamplingParams) narrow their type.
# Token ids and counts travel as INT32 (the engine then checks them against its vocabulary
# and context): a larger count is a 400 naming it, not a number that wraps on the way.
INT32_MAX = 2**31 - 1
TokenId = Annotated[Int, Field(ge=0, le=INT32_MAX)]
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}, "minItems": 1}
_NONEMPTY = {"type": "array", "items": {"type": "string", "minLength": 1}}
_LOGIT_BIAS = {"anyOf": [{"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                          "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
                         {"type": "null"}]}
_STREAM_OPTIONS = {"if": {"properties": {"stream_options": {"type": "object"}}, "required": ["stream_options"]},
                   "then": {"properties": {"stream": {"const": True}}, "required": ["stream"]}}
_PROMPT = {"anyOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS,
                     {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                     {"type": "array", "items": _TOKEN_IDS, "minItems": 1}]}


class _CommonFields(NullMeansDefault):
    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra=_STREAM_OPTIONS)

    model: str
    max_tokens: Optional[Int] = Field(None, ge=1, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: Int = Field(1, ge=1, le=INT32_MAX)           # the engine's max_n bounds it
    stop: Union[None, str, list[str]] = Field(None, json_schema_extra={"anyOf": [{"type": "string"}, _NONEMPTY,
                                                                                 {"type": "null"}]})
    seed: Optional[Int] = Field(None, ge=-2**63, le=2**63 - 1)     # int64, as OpenAI's
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = Field(None, json_schema_extra=_LOGIT_BIAS)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None                      # accepted, unused
    # vLLM's extras
    top_k: Int = Field(-1, ge=-1, le=INT32_MAX)
    repetition_penalty: float = Field(1.0, ge=1e-30, le=1e30)  # the engine's float32-safe range
    min_tokens: Int = Field(0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    bad_words: Optional[list[str]] = Field(None, json_schema_extra={"anyOf": [{**_NONEMPTY, "maxItems": 128},
                                                                              {"type": "null"}]})
    guided_json: Union[None, dict, str] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = Field(None, json_schema_extra={"anyOf": [{**_NONEMPTY, "minItems": 1},
                                                                                  {"type": "null"}]})
    guided_grammar: Optional[str] = None
    response_format: Optional[ResponseFormat] = None
    # A server-side deadline for this request, at most the engine's request_timeout_s: past
    # it the engine aborts the request and frees its KV cache (504).
    request_timeout_s: Optional[float] = Field(None, gt=0)
    # vLLM's: with the engine's scheduling_policy "priority", lower runs first; refused
    # (400) by an FCFS engine unless 0.
    priority: Int = Field(0, ge=-2**31, le=2**31 - 1)

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, v, info):
        if v is not None and not info.data.get("stream"):      # OpenAI's and vLLM's rule
            raise ValueError("`stream_options` can only be used when `stream` is True")   # Triton's words
        return v

    def sampling_parameters(self, max_tokens: Optional[int]) -> dict[str, Any]:
        p: dict[str, Any] = {
            "n": self.n, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens, "ignore_eos": self.ignore_eos,
            **{proc.name: getattr(self, proc.name) for proc in PROCESSORS}}
        if max_tokens is not None:
            p["max_tokens"] = max_tokens
        if self.stop:
            p["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        if self.seed is not None:
            p["seed"] = self.seed
        if self.bad_words is not None:
            p["bad_words"] = self.bad_words
        if self.request_timeout_s is not None:
            p["request_timeout_s"] = self.request_timeout_s
        if self.priority:
            p["priority"] = self.priority
        if self.logit_bias:
            try:
                p["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise APIError(400, "logit_bias keys must be token ids", "logit_bias") from None
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                p[name] = getattr(self, name)
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            p["guided_json_object"] = True
        elif fmt is not None and fmt.type == "json_schema":
            schema = (fmt.json_schema or {}).get("schema")
            if not isinstance(schema, dict):
                raise APIError(400, "response_format.json_schema.schema must be a JSON schema object",
                               "response_format")
            p["guided_json"] = schema
        return p


# The logits processors' parameters, with the engine's bounds (so /openapi.json declares them).
_Common = create_model("_Common", __base__=_CommonFields, __module__=__name__, **request_fields())


class CompletionRequest(_Common):
    # A list of prompts gets one set of n choices each (completions.py).
    prompt: Union[str, list[TokenId], list[str], list[list[TokenId]]] = Field(json_schema_extra=_PROMPT)
    max_tokens: Optional[Int] = Field(16, ge=0, le=INT32_MAX,
                                      description="0 only with echo (the prompt alone, as vLLM)")
    logprobs: Optional[Int] = Field(None, ge=0, le=INT32_MAX)     # the engine's max_logprobs bounds it
    echo: bool = False
    # vLLM's extra: each choice's `prompt_logprobs` (echo with logprobs implies them).
    prompt_logprobs: Optional[Int] = Field(None, ge=0, le=INT32_MAX)
    suffix: Optional[str] = Field(None, json_schema_extra={"anyOf": [{"const": ""}, {"type": "null"}]})
    best_of: Optional[Int] = Field(None, ge=1, le=INT32_MAX, description="n, if given")

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        # Sent on, an empty prompt came back as the engine's words ("the request has no
        # prompt: 'text_input' is missing or empty"); the declared schema refuses it too.
        if isinstance(v, str):
            if not v:
                raise ValueError("the prompt is empty: give at least one character or token id")
        elif not v:
            raise ValueError("the list of prompts is empty")
        elif any(isinstance(p, (str, list)) and not p for p in v):
            raise ValueError("a prompt in the list is empty: give at least one character or token id each")
        return v

    @field_validator("suffix")
    @classmethod
    def _unsupported(cls, v):
        if v:
            raise ValueError("not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v, info):
        # A field validator (not a model one): the 400 names best_of. n is validated first.
        n = info.data.get("n")
        if v is not None and n is not None and v != n:
            raise ValueError(f"best_of other than n is not supported (got best_of={v}, n={n}): "
                             "leave it out or set it to n")
        return v


_PART = {"anyOf": [
    {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
     "required": ["type", "text"]},
    {"type": "object", "properties": {"type": {"const": "image_url"}, "image_url": {
        "type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]}},
     "required": ["type", "image_url"]}]}
# Only an assistant message may go without content.
_CONTENT_NEEDED = {"if": {"properties": {"role": {"not": {"const": "assistant"}}}},
                   "then": {"properties": {"content": {"not": {"type": "null"}}}, "required": ["content"]}}


class ChatMessage(BaseModel):
    # extra: the fields of tool calling (tool_calls, tool_call_id, name) pass through to the template
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=_CONTENT_NEEDED)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[None, str, list[dict[str, Any]]] = Field(None, json_schema_extra={"anyOf": [
        {"type": "string"}, {"type": "array", "items": _PART}, {"type": "null"}]})
    tool_calls: Optional[list[MessageToolCall]] = None     # an assistant turn's calls
    tool_call_id: Optional[str] = None                      # a tool turn: the call it answers

    def for_template(self) -> dict:
        """The message as chat templates read it: text content, and each call's arguments
        as a dict (templates write them with tojson), as vLLM passes them."""
        m = {**self.model_dump(exclude_none=True), "content": self.text()}
        if self.image_urls():
            # With images, content parts as vision-language templates read them: each
            # image a {"type": "image"} where it stood (its URL goes to the engine).
            m["content"] = [{"type": "image"} if image_url_of(p) is not None else p
                            for p in self.content if p.get("type") == "text" or image_url_of(p) is not None]
        if self.tool_calls:
            m["tool_calls"] = [{**c.model_dump(), "function": {"name": c.function.name,
                                                               "arguments": _json_or_text(c.function.arguments)}}
                               for c in self.tool_calls]
        return m

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v):
        if isinstance(v, list):
            check_parts(v)
        return v

    @model_validator(mode="after")
    def _content_needed(self) -> "ChatMessage":
        # An assistant turn may be tool calls alone (content null); every other role says something.
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a '{self.role}' message needs content (only an assistant message may have none)")
        return self

    def image_urls(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [url for url in map(image_url_of, self.content) if url is not None]

    def text(self) -> str:
        if isinstance(self.content, list):     # content parts: the text ones
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


# More messages than this are a 400, counted before any is validated: 400k tiny messages
# (16 MiB) took about 2 s of pydantic and 0.6 s more to convert and render, per request,
# and every stream of the frontend waited 4.3 s. 16k validate in about 60 ms; a 128k-token
# context holds fewer (each message costs its role's tokens too).
MAX_CHAT_MESSAGES = 16384


def at_most_messages(value: Any, what: str = "messages") -> Any:
    if isinstance(value, list) and len(value) > MAX_CHAT_MESSAGES:
        raise ValueError(f"{what} has {len(value)} items, more than the {MAX_CHAT_MESSAGES} a request may have")
    return value


Messages = Annotated[list[ChatMessage], BeforeValidator(at_most_messages)]


class ChatCompletionRequest(_Common):
    messages: Messages = Field(min_length=1)
    max_completion_tokens: Optional[Int] = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: Optional[Int] = Field(None, ge=0, le=20)  # OpenAI's bound (and the engine's max_logprobs)
    tools: Optional[list[ChatTool]] = None
    tool_choice: Union[None, Literal["none", "auto", "required"], NamedToolChoice] = None
    parallel_tool_calls: bool = True
    # The legacy form of tools (one call per reply, answered as `function_call`)
    functions: Optional[list[FunctionDefinition]] = None
    function_call: Union[None, Literal["none", "auto"], FunctionName] = None
    # vLLM's extra: variables for the chat template (e.g. {"enable_thinking": true})
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _logprobs(self) -> "ChatCompletionRequest":
        if self.functions is not None and self.tools is not None:
            raise ValueError("give tools or functions, not both")
        return self

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v, info):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("`top_logprobs` can only be used when `logprobs` is True")
        return v

    def tool_arguments(self) -> tuple[Optional[list[dict]], Any, bool]:
        """(tools, tool_choice, legacy) in the tools form, whichever form was sent."""
        if self.functions is not None:
            choice = self.function_call
            if isinstance(choice, FunctionName):
                choice = {"type": "function", "function": {"name": choice.name}}
            tools = [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in self.functions]
            return tools or None, choice, True
        tools = [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        return tools, choice, False


def _json_or_text(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def parse(model_cls: type[BaseModel], body: Any):
    """The request body as `model_cls`, or a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        # The field's path, without pydantic's union-member tags ("prompt.str" -> "prompt").
        param = ".".join(str(p) for p in err["loc"] if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p)))
        param = param or None
        msg = err["msg"].removeprefix("Value error, ")
        if err.get("input", ...) is None and err["type"].endswith("_type"):
            msg = f"it must not be null ({msg[:1].lower()}{msg[1:]})"     # a required field (nulls.py)
        raise APIError(400, f"invalid '{param}': {msg}" if param else msg, param) from None
