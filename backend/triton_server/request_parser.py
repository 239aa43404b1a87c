"""Triton request tensors -> (prompt, SamplingParams, response options).

The contract is Triton's vLLM backend's (text_input, stream, sampling_parameters JSON,
exclude_input_in_output, return_*), plus the scalar inputs of TensorRT-LLM's ensemble
and an optional pre-tokenized `input_ids`. Pure Python over numpy arrays so that it can
be tested, and fuzzed, without a server. Every problem raises InvalidRequestError with
a message that names the input at fault.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import numpy as np

from backend.engine.errors import InvalidRequestError
from backend.engine.prompt_length import tokenize_within
from backend.engine.request_limits import RequestLimits
from backend.sampling_params import SamplingParams, SamplingParamsError, json_object
from backend.triton_server.stop_key import STOP_KEY, stop_key_of

BOOL_INPUTS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
               "return_num_output_tokens", "return_cumulative_logprob", "return_logprobs", "ignore_eos",
               "return_prompt_logprobs")

# TensorRT-LLM ensemble scalar inputs -> SamplingParams field.
SCALAR_INPUTS = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "seed": "seed",
    "random_seed": "seed",
    "min_tokens": "min_tokens",
    "min_length": "min_tokens",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}

# Everything model.py declares; any other input is refused by Triton itself.
INPUT_SPECS: list[dict[str, Any]] = (
    [{"name": "text_input", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
     {"name": "input_ids", "data_type": "TYPE_INT32", "dims": [-1], "optional": True},
     {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
     {"name": "stop_words", "data_type": "TYPE_STRING", "dims": [-1], "optional": True},
     {"name": "end_id", "data_type": "TYPE_INT32", "dims": [1], "optional": True},
     {"name": "beam_width", "data_type": "TYPE_INT32", "dims": [1], "optional": True},
     # TensorRT-LLM's way to end a request: `stop` true, with that request's id.
     {"name": "stop", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
     # The vLLM backend's image input: one base64-encoded image file per element (a
     # data: URL is taken too), for a vision-language model.
     {"name": "image", "data_type": "TYPE_STRING", "dims": [-1], "optional": True}]
    + [{"name": n, "data_type": "TYPE_BOOL", "dims": [1], "optional": True} for n in BOOL_INPUTS]
    + [{"name": n, "data_type": t, "dims": [1], "optional": True} for n, t in (
        ("max_tokens", "TYPE_INT32"), ("temperature", "TYPE_FP32"), ("top_k", "TYPE_INT32"),
        ("top_p", "TYPE_FP32"), ("min_p", "TYPE_FP32"), ("seed", "TYPE_UINT64"),
        ("random_seed", "TYPE_UINT64"), ("min_tokens", "TYPE_INT32"), ("min_length", "TYPE_INT32"),
        ("repetition_penalty", "TYPE_FP32"), ("presence_penalty", "TYPE_FP32"),
        ("frequency_penalty", "TYPE_FP32"))]
)

OUTPUT_SPECS: list[dict[str, Any]] = [
    {"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "cumulative_logprob", "data_type": "TYPE_FP32", "dims": [-1]},
    {"name": "logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
    # With return_prompt_logprobs: the sampling parameter prompt_logprobs' result as
    # JSON (vLLM's RequestOutput.prompt_logprobs: null first), once per request.
    {"name": "prompt_logprobs", "data_type": "TYPE_STRING", "dims": [1]},
    {"name": "num_input_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "num_output_tokens", "data_type": "TYPE_UINT32", "dims": [-1]},
    {"name": "output_ids", "data_type": "TYPE_INT32", "dims": [-1]},
]
# A model with parameter runner "pooling" (an embedding model) has this output too: the
# prompt's pooled final hidden state, [hidden] (text_output is then "" and output_ids empty).
EMBEDDING_SPEC: dict[str, Any] = {"name": "embedding", "data_type": "TYPE_FP32", "dims": [-1]}


@dataclass
class ParsedRequest:
    prompt: Union[str, list[int]]
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = True
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_cumulative_logprob: bool = False
    return_logprobs: bool = False
    # The client asked for logprobs (sampling parameter `logprobs`); otherwise they are
    # computed only for `return_cumulative_logprob`, and `logprobs` says null, as vLLM's.
    logprobs_requested: bool = False
    return_prompt_logprobs: bool = False
    prompt_text: str = ""
    stop_key: Optional[str] = None   # what a `stop` must carry to end this request (stop_key.py)
    images: list[bytes] = field(default_factory=list)   # input `image`, decoded from base64

    def engine_prompt(self) -> Union[str, list[int], dict]:
        """The prompt as the engine takes it: with images, vLLM's prompt dict."""
        if not self.images:
            return self.prompt
        key = "prompt" if isinstance(self.prompt, str) else "prompt_token_ids"
        return {key: self.prompt, "multi_modal_data": {"image": self.images}}


def _scalar(name: str, arr: np.ndarray) -> Any:
    if arr.size != 1:
        raise InvalidRequestError(f"input '{name}' must hold exactly one value, got shape {list(arr.shape)}")
    return arr.reshape(-1)[0]


def _text(name: str, value: Any) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidRequestError(f"input '{name}' is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if isinstance(value, str):
        return value
    raise InvalidRequestError(f"input '{name}' must be a string (BYTES), got {type(value).__name__}")


def _bool(name: str, arr: np.ndarray) -> bool:
    v = _scalar(name, arr)
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    raise InvalidRequestError(f"input '{name}' must be BOOL")


def _number(name: str, arr: np.ndarray) -> Union[int, float]:
    v = _scalar(name, arr)
    if isinstance(v, (np.integer, int)) and not isinstance(v, (bool, np.bool_)):
        return int(v)
    if isinstance(v, (np.floating, float)):
        f = float(v)
        if not math.isfinite(f):
            raise InvalidRequestError(f"input '{name}' must be a finite number, got {f}")
        return f
    raise InvalidRequestError(f"input '{name}' must be numeric")


# The sampling parameters' JSON, and the request parameters': 4 MiB leaves room for a
# logit_bias over a whole vocabulary (150k entries, about 2 MB) and large schemas, and
# refuses the 16 MiB a client can send, which C json.loads would read on the execute thread.
MAX_PARAMETERS_JSON_BYTES = 4 << 20


def _json_size(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return sum(len(v) if isinstance(v, (bytes, str)) else 0 for v in value.reshape(-1))
    return len(value)


def parse_sampling_json(raw: str) -> dict[str, Any]:
    try:
        obj = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"input 'sampling_parameters' is not valid JSON: {e.msg} "
                                  f"(line {e.lineno} column {e.colno})") from None
    except RecursionError:              # json recurses per level (was an INTERNAL error)
        raise InvalidRequestError("input 'sampling_parameters' nests too deeply to be read") from None
    if not isinstance(obj, dict):
        raise InvalidRequestError("input 'sampling_parameters' must be a JSON object")
    return obj


def _coerce_json_value(key: str, value: Any) -> Any:
    """vLLM's backend accepts values as strings ("0.8", "true", "[1, 2]"); so do we."""
    if isinstance(value, str) and key in ("stop_token_ids",):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise InvalidRequestError(f"sampling parameter '{key}' must be a list of integers") from None
    if isinstance(value, str) and key in ("stop", "bad_words", "bad_words_token_ids") and value.startswith("["):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


_DEFAULT_LIMITS = RequestLimits.defaults()

# The vLLM backend's `structured_outputs` (vLLM's StructuredOutputsParams) -> our fields.
STRUCTURED_OUTPUTS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                      "grammar": "guided_grammar", "json_object": "guided_json_object"}


def structured_outputs(value: Any) -> dict[str, Any]:
    """`structured_outputs` as the vLLM backend takes it: a JSON object (or its text)
    with one of json, regex, choice, grammar, json_object."""
    try:
        value = json_object(value) if isinstance(value, str) else value
        if not isinstance(value, dict):
            raise ValueError("must be a JSON object")
    except ValueError as e:
        raise InvalidRequestError(f"sampling parameter 'structured_outputs' {e}") from None
    unknown = sorted(set(value) - set(STRUCTURED_OUTPUTS))
    if unknown:
        raise InvalidRequestError(f"unknown key '{unknown[0]}' in sampling parameter 'structured_outputs' "
                                  f"(supported: {', '.join(STRUCTURED_OUTPUTS)})")
    return {STRUCTURED_OUTPUTS[k]: v for k, v in value.items() if v not in (None, False)}


def _tokenizes_to(tokenize: Callable[[str], list[int]], text: str, ids: list[int]) -> bool:
    """Whether `text` tokenizes to `ids`, tokenizing about len(ids) tokens' worth of it at
    most (len(ids) is bounded by max_model_len before this): a 16 MB text beside
    `input_ids=[1]` was tokenized whole on the execute thread (55 s that every new request
    waited), past the prompt-length check (prompt_length.py)."""
    try:
        return tokenize_within(tokenize, text, len(ids) + 1) == ids
    except InvalidRequestError:         # it has more tokens than ids: they cannot agree
        return False


def parse_request(inputs: dict[str, np.ndarray],
                  tokenize: Optional[Callable[[str], list[int]]] = None,
                  request_parameters: str = "", limits: Optional[RequestLimits] = None,
                  max_model_len: Optional[int] = None) -> ParsedRequest:
    """`inputs` maps input name -> numpy array as Triton delivered it (absent = not sent).
    `request_parameters` is the request's own parameters as JSON (Triton's
    `request.parameters()`): the sampling parameters when the tensor is absent, as the
    vLLM backend takes them. `limits`: the engine's per-request limits (default: the
    engine arguments' defaults), checked here, before n fans out. `max_model_len`: input_ids
    that leave no room for one generated token are refused here, before any text beside
    them is tokenized."""
    text: Optional[str] = None
    if "text_input" in inputs:
        text = _text("text_input", _scalar("text_input", inputs["text_input"]))
    input_ids: Optional[list[int]] = None
    if "input_ids" in inputs:
        arr = inputs["input_ids"]
        if not np.issubdtype(arr.dtype, np.integer):
            raise InvalidRequestError("input 'input_ids' must be INT32 token ids")
        input_ids = arr.reshape(-1).tolist()    # in C: millions of ids in milliseconds

    if input_ids and max_model_len is not None and len(input_ids) >= max_model_len:
        raise InvalidRequestError(f"input 'input_ids' has {len(input_ids)} tokens; max_model_len is {max_model_len}, "
                                  "which must leave room for at least one generated token")
    if input_ids:
        if text and tokenize is not None and not _tokenizes_to(tokenize, text, input_ids):
            raise InvalidRequestError("inputs 'text_input' and 'input_ids' disagree: "
                                      "the text does not tokenize to those ids; send one of them")
        prompt: Union[str, list[int]] = input_ids
    elif text:
        prompt = text
    else:
        raise InvalidRequestError("the request has no prompt: 'text_input' is missing or empty "
                                  "(and no 'input_ids' were sent)")

    # (Both are read on the model's execute thread, the request parameters twice: bounded.)
    for name, value in (("request parameters", request_parameters),
                        ("input 'sampling_parameters'", inputs.get("sampling_parameters"))):
        if value is not None and _json_size(value) > MAX_PARAMETERS_JSON_BYTES:
            raise InvalidRequestError(f"{name}: {_json_size(value)} bytes of JSON, more than "
                                      f"{MAX_PARAMETERS_JSON_BYTES}")
    stop_key = stop_key_of(request_parameters)
    raw = request_parameters
    if "sampling_parameters" in inputs:
        raw = _text("sampling_parameters", _scalar("sampling_parameters", inputs["sampling_parameters"]))
    fields: dict[str, Any] = {key: _coerce_json_value(key, value) for key, value in parse_sampling_json(raw).items()
                              if not (key == STOP_KEY and raw is request_parameters)}

    if "structured_outputs" in fields:
        fields.update(structured_outputs(fields.pop("structured_outputs")))

    def merge(key: str, value: Any, source: str) -> None:
        if key in fields and fields[key] != value:
            raise InvalidRequestError(f"'{key}' is given twice with different values "
                                      f"({fields[key]!r} in sampling_parameters, {value!r} in input '{source}')")
        fields[key] = value

    for name, key in SCALAR_INPUTS.items():
        if name in inputs:
            merge(key, _number(name, inputs[name]), name)
    if "ignore_eos" in inputs:
        merge("ignore_eos", _bool("ignore_eos", inputs["ignore_eos"]), "ignore_eos")
    if "stop_words" in inputs:
        words = [_text("stop_words", w) for w in inputs["stop_words"].reshape(-1)]
        stop = fields.get("stop") or []
        fields["stop"] = ([stop] if isinstance(stop, str) else list(stop)) + [w for w in words if w]
    if "end_id" in inputs:
        end_id = _number("end_id", inputs["end_id"])
        fields["stop_token_ids"] = list(fields.get("stop_token_ids") or []) + [end_id]
    if "beam_width" in inputs and _number("beam_width", inputs["beam_width"]) != 1:
        raise InvalidRequestError("input 'beam_width' must be 1: beam search is not supported")

    try:
        params = SamplingParams.create(**fields)
    except SamplingParamsError as e:
        raise InvalidRequestError(str(e)) from None
    (limits or _DEFAULT_LIMITS).check(params)

    flags = {n: _bool(n, inputs[n]) for n in BOOL_INPUTS if n in inputs and n != "ignore_eos"}
    # As the vLLM backend: without the input, a single response echoes the prompt and a
    # stream does not; a stream cannot echo it.
    flags.setdefault("exclude_input_in_output", bool(flags.get("stream", False)))
    if flags.get("stream") and not flags["exclude_input_in_output"]:
        raise InvalidRequestError("Error generating stream: When streaming, `exclude_input_in_output` = False "
                                  "is not allowed.")  # the vLLM backend's words
    images = _images(inputs["image"]) if "image" in inputs else []
    requested = params.logprobs is not None
    if flags.get("return_cumulative_logprob") and not requested:
        params = params.model_copy(update={"logprobs": 0})
    return ParsedRequest(prompt=prompt, params=params, prompt_text=text or "", logprobs_requested=requested,
                         stop_key=stop_key, images=images, **flags)


def _images(arr: np.ndarray) -> list[bytes]:
    """Input `image`: base64 text per element (or a data: URL's), as bytes. Decoding the
    image itself is the engine's (backend/multimodal/images.py), with its limits."""
    out = []
    for i, value in enumerate(arr.reshape(-1)):
        text = _text("image", value).strip()
        if text.startswith("data:"):
            header, _, text = text.partition(",")
            if ";base64" not in header:
                raise InvalidRequestError(f"input 'image' element {i}: a data URL must be base64-encoded")
        try:
            out.append(base64.b64decode(text, validate=True))
        except (binascii.Error, ValueError):
            raise InvalidRequestError(f"input 'image' element {i} is not valid base64") from None
    return out
