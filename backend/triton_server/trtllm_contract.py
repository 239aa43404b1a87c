"""TensorRT-LLM's Triton contract, translated to and from our `llm` model's.

TensorRT-LLM users call `ensemble` or `tensorrt_llm_bls` (text in, text out) or
`tensorrt_llm` (token ids in and out), with `max_batch_size > 0` so every tensor has a
leading batch dimension. Here each row becomes one request to the `llm` model (one engine,
one copy of the weights), and each of its responses one response in TensorRT-LLM's
names, shapes and conventions. Pure numpy: tested without a server.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from backend.engine.errors import InvalidRequestError
from backend.triton_server import trtllm_images

TEXT, TOKENS = "text", "tokens"
CONTRACTS = (TEXT, TOKENS)


def _spec(name: str, dtype: str, dims: list[int], optional: bool = True) -> dict[str, Any]:
    return {"name": name, "data_type": dtype, "dims": dims, "optional": optional}


# Sampling inputs both contracts share (TensorRT-LLM's names -> ours).
_SAMPLING = [("temperature", "TYPE_FP32"), ("repetition_penalty", "TYPE_FP32"), ("presence_penalty", "TYPE_FP32"),
             ("frequency_penalty", "TYPE_FP32"), ("min_length", "TYPE_INT32"), ("min_tokens", "TYPE_INT32"),
             ("random_seed", "TYPE_UINT64"), ("num_return_sequences", "TYPE_INT32"), ("beam_width", "TYPE_INT32"),
             ("end_id", "TYPE_INT32"), ("pad_id", "TYPE_INT32"), ("exclude_input_in_output", "TYPE_BOOL"),
             ("return_log_probs", "TYPE_BOOL"), ("return_context_logits", "TYPE_BOOL"),
             ("return_generation_logits", "TYPE_BOOL"), ("return_perf_metrics", "TYPE_BOOL")]

INPUT_SPECS = {
    TEXT: [_spec("text_input", "TYPE_STRING", [1], optional=False), _spec("max_tokens", "TYPE_INT32", [1], False),
           _spec("stream", "TYPE_BOOL", [1]), _spec("top_k", "TYPE_INT32", [1]), _spec("top_p", "TYPE_FP32", [1]),
           _spec("length_penalty", "TYPE_FP32", [1]), _spec("stop_words", "TYPE_STRING", [-1]),
           _spec("bad_words", "TYPE_STRING", [-1]), _spec("embedding_bias_words", "TYPE_STRING", [-1]),
           _spec("embedding_bias_weights", "TYPE_FP32", [-1]), _spec("decoder_text_input", "TYPE_STRING", [1]),
           _spec("prompt_embedding_table", "TYPE_FP16", [-1, -1]), _spec("prompt_vocab_size", "TYPE_INT32", [1]),
           _spec("prompt_table_extra_id", "TYPE_UINT64", [1]), _spec("lora_task_id", "TYPE_UINT64", [1]),
           _spec("lora_weights", "TYPE_FP16", [-1, -1]), _spec("lora_config", "TYPE_INT32", [-1, 3]),
           _spec("guided_decoding_guide_type", "TYPE_STRING", [1]), _spec("guided_decoding_guide", "TYPE_STRING", [1]),
           _spec("num_draft_tokens", "TYPE_INT32", [1]), _spec("use_draft_logits", "TYPE_BOOL", [1])]
    + [_spec(n, t, [1]) for n, t in _SAMPLING] + trtllm_images.INPUT_SPECS,
    TOKENS: [_spec("input_ids", "TYPE_INT32", [-1], optional=False), _spec("input_lengths", "TYPE_INT32", [1], False),
             _spec("request_output_len", "TYPE_INT32", [1], False), _spec("streaming", "TYPE_BOOL", [1]),
             _spec("stop", "TYPE_BOOL", [1]), _spec("runtime_top_k", "TYPE_INT32", [1]),
             _spec("runtime_top_p", "TYPE_FP32", [1]), _spec("len_penalty", "TYPE_FP32", [1]),
             _spec("stop_words_list", "TYPE_INT32", [2, -1]), _spec("bad_words_list", "TYPE_INT32", [2, -1]),
             _spec("embedding_bias", "TYPE_FP32", [-1]), _spec("prompt_embedding_table", "TYPE_FP16", [-1, -1]),
             _spec("lora_task_id", "TYPE_UINT64", [1]), _spec("lora_weights", "TYPE_FP16", [-1, -1]),
             _spec("lora_config", "TYPE_INT32", [-1, 3]), _spec("draft_input_ids", "TYPE_INT32", [-1])]
    + [_spec(n, t, [1]) for n, t in _SAMPLING],
}

_COMMON_OUTPUTS = [{"name": "cum_log_probs", "data_type": "TYPE_FP32", "dims": [-1]},
                   {"name": "output_log_probs", "data_type": "TYPE_FP32", "dims": [-1, -1]},
                   {"name": "batch_index", "data_type": "TYPE_INT32", "dims": [1]},
                   {"name": "sequence_index", "data_type": "TYPE_INT32", "dims": [1]}]
OUTPUT_SPECS = {
    TEXT: [{"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]}] + _COMMON_OUTPUTS,
    TOKENS: [{"name": "output_ids", "data_type": "TYPE_INT32", "dims": [-1, -1]},
             {"name": "sequence_length", "data_type": "TYPE_INT32", "dims": [-1]}] + _COMMON_OUTPUTS,
}

# Inputs that ask for something this engine does not do: any value but an empty/zero/false
# one is a per-request error naming the input.
UNSUPPORTED = {
    "embedding_bias_words": "embedding bias is not supported", "embedding_bias_weights":
    "embedding bias is not supported", "embedding_bias": "embedding bias is not supported",
    "return_context_logits": "context logits are not returned", "return_generation_logits":
    "generation logits are not returned", "return_perf_metrics": "per-request perf metrics are not returned",
    "decoder_text_input": "encoder-decoder models are not supported", "prompt_embedding_table":
    "prompt tuning is not supported", "prompt_vocab_size": "prompt tuning is not supported",
    "prompt_table_extra_id": "prompt tuning is not supported", "lora_task_id": "LoRA is not supported yet",
    "lora_weights": "LoRA is not supported yet", "lora_config": "LoRA is not supported yet",
    "guided_decoding_guide_type": "guided decoding is not supported yet", "guided_decoding_guide":
    "guided decoding is not supported yet", "num_draft_tokens": "speculative decoding is not supported yet",
    "use_draft_logits": "speculative decoding is not supported yet", "draft_input_ids":
    "speculative decoding is not supported yet",
}
# TensorRT-LLM name -> our sampling parameter.
SCALARS = {"max_tokens": "max_tokens", "request_output_len": "max_tokens", "temperature": "temperature",
           "top_k": "top_k", "runtime_top_k": "top_k", "top_p": "top_p", "runtime_top_p": "top_p",
           "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty", "min_length": "min_tokens", "min_tokens": "min_tokens",
           "random_seed": "seed", "num_return_sequences": "n"}


# Every one-value-per-row input read here. pad_id and the length penalties are accepted
# and unused: nothing is padded, and a length penalty only acts on beam search.
ROW_SCALARS = set(SCALARS) | {"beam_width", "stream", "streaming", "exclude_input_in_output", "return_log_probs",
                              "end_id", "pad_id", "length_penalty", "len_penalty", "input_lengths"}


@dataclass
class RowRequest:
    """One batch row, as a request to the `llm` model."""
    batch_index: int
    inputs: dict[str, np.ndarray]       # the llm model's input tensors
    stream: bool
    return_log_probs: bool
    prompt_ids: list[int] = field(default_factory=list)  # tokens mode: echoed unless excluded
    exclude_input_in_output: bool = False


def _is_set(value: np.ndarray) -> bool:
    if value.size == 0:
        return False
    if value.dtype == np.object_:
        return any(bytes(v) != b"" for v in value.reshape(-1))
    return bool(np.any(value != 0))


def _row(inputs: dict[str, np.ndarray], name: str, b: int) -> Optional[np.ndarray]:
    """Row b of an input; a single row serves every row of the batch."""
    value = inputs.get(name)
    if value is None:
        return None
    if value.shape[0] == 1:
        return value[0]
    if b >= value.shape[0]:
        raise InvalidRequestError(f"input '{name}' has {value.shape[0]} rows; the batch has more")
    return value[b]


def _scalar(name: str, row: np.ndarray) -> Any:
    if row.size != 1:
        raise InvalidRequestError(f"input '{name}' must hold one value per batch row, got {row.size}")
    return row.reshape(-1)[0].item()


def batch_size(contract: str, inputs: dict[str, np.ndarray]) -> int:
    first = inputs["text_input" if contract == TEXT else "input_ids"]
    return int(first.shape[0])


def row_request(contract: str, inputs: dict[str, np.ndarray], b: int) -> RowRequest:
    """Batch row `b` of a TensorRT-LLM request as an `llm` request. Raises
    InvalidRequestError naming the input for anything it cannot serve."""
    for name, why in UNSUPPORTED.items():
        row = _row(inputs, name, b)
        if row is not None and _is_set(row):
            raise InvalidRequestError(f"input '{name}': {why} by this backend")
    get = {name: _scalar(name, _row(inputs, name, b)) for name in inputs if name in ROW_SCALARS}
    if get.get("beam_width", 1) != 1:
        raise InvalidRequestError(f"input 'beam_width' is {get['beam_width']}: beam search is not supported "
                                  "(beam_width must be 1)")
    params: dict[str, Any] = {}
    for name, key in SCALARS.items():
        if name in get:
            params[key] = get[name]
    # TensorRT-LLM samples greedily unless top_k or top_p asks otherwise; 0 disables each.
    if params.get("top_k", 0) in (0, 1) and params.get("top_p", 0.0) == 0.0:
        params["temperature"] = 0.0
        params.pop("top_k", None), params.pop("top_p", None)
    else:
        if params.get("top_k") == 0:
            params["top_k"] = -1
        if params.get("top_p") == 0.0:
            params["top_p"] = 1.0
    stop_ids: list[int] = []
    if "end_id" in get:  # TensorRT-LLM's end_id replaces the checkpoint's EOS; -1: none
        params["ignore_eos"] = True
        if int(get["end_id"]) >= 0:
            stop_ids.append(int(get["end_id"]))
    out: dict[str, np.ndarray] = {}
    prompt_ids: list[int] = []
    if contract == TEXT:
        out["text_input"] = np.array([bytes(_row(inputs, "text_input", b).reshape(-1)[0])], dtype=np.object_)
        stop_words = _row(inputs, "stop_words", b)
        if stop_words is not None:
            words = [bytes(w) for w in stop_words.reshape(-1) if bytes(w)]
            if words:
                out["stop_words"] = np.array(words, dtype=np.object_)
        images = trtllm_images.row_images({n: _row(inputs, n, b) for n in trtllm_images.IMAGE_INPUTS})
        if images:
            out["image"] = np.array(images, dtype=np.object_)
        bad_words = _text_words("bad_words", _row(inputs, "bad_words", b))
        if bad_words:
            params["bad_words"] = bad_words
        stream = bool(get.get("stream", False))
    else:
        ids = _row(inputs, "input_ids", b).reshape(-1)
        length = int(get.get("input_lengths", ids.size))
        if not 0 < length <= ids.size:
            raise InvalidRequestError(f"input 'input_lengths' is {length}; the row has {ids.size} input_ids")
        prompt_ids = [int(t) for t in ids[:length]]
        out["input_ids"] = np.array(prompt_ids, dtype=np.int32)
        stop_ids += _single_token_words(_row(inputs, "stop_words_list", b))
        bad_ids = word_list("bad_words_list", _row(inputs, "bad_words_list", b))
        if any(t < 0 for word in bad_ids for t in word):
            raise InvalidRequestError("input 'bad_words_list': token ids must be >= 0")
        if bad_ids:
            params["bad_words_token_ids"] = bad_ids
        stream = bool(get.get("streaming", False))
    if stop_ids:
        params["stop_token_ids"] = stop_ids
    return_log_probs = bool(get.get("return_log_probs", False))
    if return_log_probs:
        params["logprobs"] = 0
    exclude = bool(get.get("exclude_input_in_output", False))
    out["sampling_parameters"] = np.array([json.dumps(params).encode()], dtype=np.object_)
    out["stream"] = np.array([stream])
    # TensorRT-LLM streams only what is new, whatever exclude_input_in_output says.
    out["exclude_input_in_output"] = np.array([stream or exclude or contract == TOKENS])
    out["return_num_output_tokens"] = np.array([True])
    out["return_finish_reason"] = np.array([True])  # tells the row's last response
    out["return_cumulative_logprob"] = np.array([return_log_probs])
    out["return_logprobs"] = np.array([return_log_probs])
    return RowRequest(b, out, stream, return_log_probs, prompt_ids, exclude or stream)


def word_list(name: str, row: Optional[np.ndarray]) -> list[list[int]]:
    """TensorRT-LLM's [2, L] word list (flat ids, then each word's end offset, padded
    with -1) -> its words as id lists."""
    if row is None or row.size == 0:
        return []
    if row.size % 2:
        raise InvalidRequestError(f"input '{name}' must have shape [2, L] per batch row (ids, then end offsets)")
    row = row.reshape(2, -1)
    ids, offsets = row[0], [int(o) for o in row[1] if o >= 0]
    words, start = [], 0
    for end in offsets:
        if not start < end <= ids.size:
            raise InvalidRequestError(f"input '{name}': end offsets must increase and stay within the "
                                      f"{ids.size} ids (got {offsets})")
        words.append([int(t) for t in ids[start:end]])
        start = end
    return words


def _single_token_words(row: Optional[np.ndarray]) -> list[int]:
    """TensorRT-LLM's stop_words_list -> stop token ids. Multi-token stop sequences are
    refused."""
    words = word_list("stop_words_list", row)
    if any(len(w) > 1 for w in words):
        raise InvalidRequestError("input 'stop_words_list': stop sequences of several tokens are not supported "
                                  "(send them as 'stop_words' text to 'ensemble' or 'tensorrt_llm_bls')")
    return [w[0] for w in words]


def _text_words(name: str, row: Optional[np.ndarray]) -> list[str]:
    """A BYTES word list as TensorRT-LLM's preprocessing reads it: each element a word,
    or several separated by commas (CSV: quote a word that holds a comma); empty words
    are dropped."""
    if row is None:
        return []
    words: list[str] = []
    for value in row.reshape(-1):
        try:
            text = bytes(value).decode("utf-8") if not isinstance(value, str) else value
        except (TypeError, UnicodeDecodeError):
            raise InvalidRequestError(f"input '{name}' must be UTF-8 text (BYTES)") from None
        try:
            words += [w for line in csv.reader([text]) for w in line if w.strip()]
        except csv.Error as e:
            raise InvalidRequestError(f"input '{name}' is not a comma-separated word list ({e})") from None
    return words


def is_last(outputs: dict[str, np.ndarray]) -> bool:
    """Whether this `llm` response is its request's last: every sequence has ended."""
    return all(bytes(r) != b"None" for r in outputs["finish_reason"].reshape(-1))


def row_responses(contract: str, row: RowRequest, outputs: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """One `llm` response (its output tensors) -> TensorRT-LLM responses for this row,
    one per sequence it carries news of (all of them in a single final response)."""
    counts = outputs["num_output_tokens"].reshape(-1)
    texts = outputs["text_output"].reshape(-1)
    ids = outputs["output_ids"].reshape(len(counts), -1) if counts.size else outputs["output_ids"]
    result = []
    for i in range(len(counts)):
        if row.stream and counts[i] == 0:
            continue
        new_ids = [int(t) for t in ids[i][:counts[i]]]
        tensors = {"batch_index": np.array([[row.batch_index]], dtype=np.int32),
                   "sequence_index": np.array([[i]], dtype=np.int32)}
        if contract == TEXT:
            tensors["text_output"] = np.array([texts[i]], dtype=np.object_)
        else:
            tokens = new_ids if row.exclude_input_in_output else row.prompt_ids + new_ids
            tensors["output_ids"] = np.array([[tokens]], dtype=np.int32)
            tensors["sequence_length"] = np.array([[len(tokens)]], dtype=np.int32)
        if row.return_log_probs:
            entries = json.loads(bytes(outputs["logprobs"].reshape(-1)[i]).decode() or "null") or []
            chosen = [next(d["logprob"] for t, d in e.items() if int(t) == tok) for e, tok in zip(entries, new_ids)]
            cumulative = float(outputs["cumulative_logprob"].reshape(-1)[i])
        else:
            # Zeros when not asked for, but present: clients name every output of the
            # model config (perf_analyzer, genai-perf), and perf_analyzer 24.10 reads an
            # absent one as a value from a zero-byte buffer: heap garbage, and when that
            # is a NaN its profile export is left empty (genai-perf then fails).
            chosen, cumulative = [0.0] * len(new_ids), 0.0
        tensors["cum_log_probs"] = np.array([[cumulative]], dtype=np.float32)
        tensors["output_log_probs"] = np.array([[chosen]], dtype=np.float32)
        result.append(tensors)
    return result
