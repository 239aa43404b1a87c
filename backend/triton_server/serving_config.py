"""config.pbtxt `parameters` -> validated engine and server settings, once, at load.

Every value arrives as a string (Triton's `string_value`); pydantic converts and checks
it, and a bad one fails the model load with a message naming the parameter.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from backend.config import ConfigError, EngineArgs, lora_modules_value, validated


class ServerSettings(BaseModel):
    """Settings of the Triton adapter itself (not the engine)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    # On unload/shutdown, how long in-flight streams may run before they are cancelled.
    grace_period_s: float = Field(10.0, ge=0.0)
    # How often client cancellations are polled.
    cancel_poll_interval_s: float = Field(0.02, gt=0.0, le=1.0)
    # Stall watchdog: while requests wait, some engine step must complete this often, or
    # the model is marked unhealthy (a deadlock or a hung kernel, not a slow step).
    engine_stall_timeout_s: float = Field(60.0, gt=0.0)
    report_metrics: bool = True


SERVER_KEYS = set(ServerSettings.model_fields)


# config.pbtxt keys of Triton's vLLM backend that mean one of our settings.
VLLM_BACKEND_KEYS = {"REPORT_CUSTOM_METRICS": "report_metrics"}


def parameters_from_model_config(model_config: dict[str, Any]) -> dict[str, str]:
    return {VLLM_BACKEND_KEYS.get(k, k): v.get("string_value", "")
            for k, v in (model_config.get("parameters") or {}).items()}


def load_settings(params: dict[str, str], model_dir: str) -> tuple[EngineArgs, ServerSettings]:
    server = {k: v for k, v in params.items() if k in SERVER_KEYS}
    engine = {k: v for k, v in params.items() if k not in SERVER_KEYS and v != ""}
    if "model" not in engine:
        raise ConfigError("missing parameter 'model': the checkpoint folder (relative to the model directory)")
    path = engine["model"]
    engine["model"] = path if os.path.isabs(path) else os.path.normpath(os.path.join(model_dir, path))
    if not os.path.isdir(engine["model"]):
        raise ConfigError(f"invalid parameter 'model': checkpoint folder '{engine['model']}' does not exist "
                          "(a local Hugging Face checkpoint folder; nothing is downloaded from a model hub)")
    for key in ("model_graph", "kv_cache_scales"):     # files of the entry
        if engine.get(key) and not os.path.isabs(engine[key]):
            engine[key] = os.path.normpath(os.path.join(model_dir, engine[key]))
    spec = engine.get("speculative_config")
    if spec:
        engine["speculative_config"] = _draft_path_from(spec, model_dir)
    if engine.get("lora_modules"):
        engine["lora_modules"] = _adapter_paths_from(engine["lora_modules"], model_dir)
    settings = validated(ServerSettings, ConfigError, "parameter", **server)
    return validated(EngineArgs, ConfigError, "parameter", **engine), settings


def _draft_path_from(spec: str, model_dir: str) -> str:
    """A draft model's folder, like `model`'s, is relative to the model directory."""
    try:
        value = json.loads(spec)
    except json.JSONDecodeError:
        return spec                     # EngineArgs names the parameter and the JSON error
    path = value.get("model") if isinstance(value, dict) else None
    if isinstance(path, str) and path and not os.path.isabs(path):
        value["model"] = os.path.normpath(os.path.join(model_dir, path))
    return json.dumps(value)


def _adapter_paths_from(modules: str, model_dir: str) -> Any:
    """LoRA adapter folders, like `model`, are relative to the model directory."""
    try:
        value = lora_modules_value(modules)
    except ValueError:
        return modules                  # EngineArgs names the parameter and the error
    if not isinstance(value, dict):
        return modules
    return {name: path if not isinstance(path, str) or os.path.isabs(path)
            else os.path.normpath(os.path.join(model_dir, path)) for name, path in value.items()}


def parameter_text(value: Any) -> str:
    """A setting as a config.pbtxt `string_value` holds it: JSON for nested settings,
    `true`/`false` for booleans."""
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def render_parameters(values: dict[str, Any]) -> str:
    """config.pbtxt `parameters` blocks for the given (already validated) values."""
    lines = []
    for key, value in values.items():
        if value is None:
            continue
        text = parameter_text(value).replace("\\", "\\\\").replace('"', '\\"')  # protobuf text format
        lines.append(f'parameters {{ key: "{key}" value: {{ string_value: "{text}" }} }}')
    return "\n".join(lines)
