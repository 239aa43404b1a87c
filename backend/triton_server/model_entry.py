"""A model repository entry's settings: config.pbtxt's `parameters` over the vLLM
backend's `<version>/model.json`, validated once.

The Triton adapter reads them from the config Triton hands it; front doors that run the
same engine without Triton (the Dynamo worker) read config.pbtxt from the folder, so one
entry serves through either with the same engine arguments.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from backend.config import ConfigError, EngineArgs
from backend.triton_server.serving_config import ServerSettings, load_settings, parameters_from_model_config
from backend.triton_server.vllm_model_json import read_model_json


def read_config_pbtxt(model_dir: str) -> dict[str, Any]:
    """config.pbtxt as the dict Triton passes a Python model (proto field names)."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    path = os.path.join(model_dir, "config.pbtxt")
    try:
        with open(path) as f:
            message = text_format.Parse(f.read(), model_config_pb2.ModelConfig())
    except FileNotFoundError:
        raise ConfigError(f"no config.pbtxt in {model_dir}: pass a model repository entry "
                          "(a folder that `python -m builder build` wrote)") from None
    except text_format.ParseError as e:
        raise ConfigError(f"{path}: {e}") from None
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def read_entry(model_dir: str, version: str = "1", model_config: Optional[dict[str, Any]] = None
               ) -> tuple[EngineArgs, ServerSettings, list[str]]:
    """(engine arguments, adapter settings, warnings) of the entry at `model_dir`. Without
    `model_config`, config.pbtxt is read from the folder."""
    if model_config is None:
        model_config = read_config_pbtxt(model_dir)
    json_params, warnings = read_model_json(model_dir, version)
    try:
        engine_args, settings = load_settings(
            {**json_params, **parameters_from_model_config(model_config)}, model_dir)
    except ConfigError as e:
        if not json_params:
            raise
        raise ConfigError(f"{e} (model.json sets: {', '.join(sorted(json_params))}; config.pbtxt "
                          "parameters win over model.json)") from None
    return engine_args, settings, warnings
