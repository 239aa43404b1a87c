"""A vLLM-backend model repository's `<version>/model.json`, read as our parameters.

Users of Triton's vLLM backend keep their engine arguments in `1/model.json` with vLLM's
names. We apply the ones we have, map the ones whose meaning carries, warn by name about
the rest, and let a wrong value fail the load naming the key (through the same pydantic
validation as `config.pbtxt` parameters). When a key is set in both places,
`config.pbtxt` wins: it is Triton's own model configuration and what `builder build` writes.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from backend.config import ConfigError
from backend.triton_server.serving_config import parameter_text

# Applied as they are: the same name and meaning here.
SAME = {"model", "dtype", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
        "enable_prefix_caching", "seed", "gpu_memory_utilization", "enforce_eager", "kv_cache_dtype",
        "max_queue_size", "tensor_parallel_size", "pipeline_parallel_size", "speculative_config", "enable_lora",
        "max_loras", "max_lora_rank", "max_cpu_loras", "max_logprobs", "async_scheduling", "enable_expert_parallel",
        "runner", "pooler_config", "scheduling_policy", "kv_offloading_size", "kv_events_config"}
RENAMED = {"num_gpu_blocks_override": "num_kv_blocks"}
DTYPES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}
KV_DTYPES = {"fp8_e4m3": "fp8"}


# vLLM's `quantization` values -> the quant_methods the checkpoint may say it has.
QUANTIZATION = {"fp8": ("paged_llm_fp8", "fp8"), "gptq": ("gptq",), "gptq_marlin": ("gptq",), "awq": ("awq",),
                "awq_marlin": ("awq",), "compressed-tensors": ("compressed-tensors",)}


def _quantization(model_dir: str, model: str) -> Callable[[Any], None]:
    """vLLM quantizes at load or reads a quantized checkpoint; here the checkpoint says
    itself (FP8 from `builder build --weights fp8`, GPTQ, AWQ, compressed-tensors), and the
    key must agree with it."""
    def check(value: Any) -> None:
        if value in (None, "", "None"):
            return
        if value not in QUANTIZATION:
            raise ConfigError(f"invalid model.json key 'quantization': {value!r}; supported: "
                              f"{', '.join(QUANTIZATION)} (a checkpoint quantized that way; fp8: written by "
                              "`python -m builder build --weights fp8`)")
        path = model if os.path.isabs(model) else os.path.join(model_dir, model)
        try:
            with open(os.path.join(path, "config.json")) as f:
                quant = (json.load(f).get("quantization_config") or {}).get("quant_method")
        except OSError:
            quant = None
        if quant not in QUANTIZATION[value]:
            hint = "; make one with `python -m builder build --weights fp8`" if value == "fp8" else ""
            raise ConfigError(f"invalid model.json key 'quantization': {value!r}, but the checkpoint's "
                              f"quantization_config says {quant!r}{hint}")
    return check


def read_model_json(model_dir: str, version: str = "1") -> tuple[dict[str, str], list[str]]:
    """(parameters as config.pbtxt would give them, warnings). No file: ({}, [])."""
    path = os.path.join(model_dir, str(version), "model.json")
    if not os.path.isfile(path):
        return {}, []
    raw = _json_object(path, "of engine arguments")
    checks = {"quantization": _quantization(model_dir, str(raw.get("model", "")))}
    params: dict[str, str] = {}
    warnings = []
    for key, value in raw.items():
        if key in checks:
            checks[key](value)
        elif key in SAME or key in RENAMED:
            if key == "dtype":
                value = DTYPES.get(value, value)
            if key == "kv_cache_dtype":
                value = KV_DTYPES.get(value, value)
            if key == "max_queue_size" and value is None:
                continue
            params[RENAMED.get(key, key)] = parameter_text(value)
        else:
            warnings.append(f"model.json key '{key}' has no effect with this backend; ignored")
    if str(raw.get("enable_lora", "")).lower() == "true":
        params["lora_modules"] = _multi_lora(os.path.join(model_dir, str(version)))
    return params, warnings


def _json_object(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"'{path}' is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"'{path}' must hold a JSON object {what}")
    return value


def _multi_lora(version_dir: str) -> str:
    """The vLLM backend's adapter list: `multi_lora.json` beside model.json, {name: folder};
    relative folders are taken from that version folder."""
    path = os.path.join(version_dir, "multi_lora.json")
    if not os.path.isfile(path):
        raise ConfigError(f"model.json sets enable_lora, but '{path}' (the adapters: {{name: folder}}) is missing")
    modules = _json_object(path, "{adapter name: folder}")
    return json.dumps({name: p if not isinstance(p, str) or os.path.isabs(p) else os.path.join(version_dir, p)
                       for name, p in modules.items()})
