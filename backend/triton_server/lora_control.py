"""LoRA adapters loaded and unloaded at run time through Triton: the Triton side of vLLM's
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (the OpenAI frontend's routes call
this).

A request to the model whose request parameters carry `lora_action` is a control request,
not a generation:

    {"lora_action": "load", "lora_name": "sql", "lora_path": "/adapters/sql", "admin_key": "..."}
    {"lora_action": "unload", "lora_name": "sql", "admin_key": "..."}
    {"lora_action": "list"}

Its one response's `text_output` is a JSON object: `{"lora_name", "status": "loaded" |
"unloaded" | "unloading"}`, or for `list` `{"loaded": [...], "unloading": [...]}`.

Inference on Triton's ports takes no key, and a load makes the server run new weights, so
`load` and `unload` must carry the server's admin key (`admin_key`, compared in constant
time): the key of Triton's restricted APIs, which the python stub reads from
`TRITON_ADMIN_KEY` or the file `TRITON_ADMIN_KEY_FILE` names (`make serve` sets it). A
server started without one refuses every change. `list` changes nothing and is open.
"""

from __future__ import annotations

import hmac
import json
import os
from typing import Optional

from backend.engine.errors import InvalidRequestError
from backend.lora.manager import RuntimeLoRAError

ACTION = "lora_action"
ACTIONS = ("load", "unload", "list")
# supervisor/admin_access.py's names (the backend does not import the supervisor).
KEY_ENV, KEY_FILE_ENV = "TRITON_ADMIN_KEY", "TRITON_ADMIN_KEY_FILE"
TIMEOUT_S = 60.0


class ControlRefused(InvalidRequestError):
    """A control request without the admin key, or on a server that has none."""


def control_of(request_parameters: str) -> Optional[dict]:
    """The request's control fields when it is a control request (it sets `lora_action`),
    else None. Malformed JSON is left to the sampling-parameter parser, which names it."""
    try:
        params = json.loads(request_parameters) if request_parameters and request_parameters.strip() else {}
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(params, dict) or ACTION not in params:
        return None
    if params[ACTION] not in ACTIONS:
        raise InvalidRequestError(f"request parameter '{ACTION}' must be one of {', '.join(ACTIONS)}, "
                                  f"not {params[ACTION]!r}")
    return params


def server_admin_key(environ=os.environ) -> Optional[str]:
    key = environ.get(KEY_ENV)
    if not key and environ.get(KEY_FILE_ENV):
        try:
            with open(environ[KEY_FILE_ENV], encoding="utf-8") as f:
                key = f.read()
        except OSError:
            return None
    return key.strip() if key and key.strip() else None


def check_admin_key(params: dict, server_key: Optional[str]) -> None:
    if server_key is None:
        raise ControlRefused(f"lora_action '{params[ACTION]}' changes what the server runs and needs the server's "
                             f"admin key, but this server has none ({KEY_ENV} or {KEY_FILE_ENV} in tritonserver's "
                             "environment; `make serve` sets it)")
    sent = params.get("admin_key")
    if not isinstance(sent, str) or not hmac.compare_digest(sent.encode(), server_key.encode()):
        raise ControlRefused(f"UNAUTHENTICATED: lora_action '{params[ACTION]}' needs request parameter 'admin_key' "
                             "(the key of Triton's restricted APIs)")


def run(loop, params: dict, server_key: Optional[str]) -> dict:
    """Carry out one control request on the engine loop (blocks up to TIMEOUT_S: call it
    off Triton's execute thread). Raises an InvalidRequestError for the caller's mistakes."""
    action = params[ACTION]
    if action == "list":
        return loop.list_loras().result(TIMEOUT_S)
    check_admin_key(params, server_key)
    name = params.get("lora_name")
    try:
        if action == "load":
            loop.add_lora(name, params.get("lora_path")).result(TIMEOUT_S)
            return {"lora_name": name, "status": "loaded"}
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("'lora_name' must be a non-empty string")
        gone = loop.remove_lora(name).result(TIMEOUT_S)
        return {"lora_name": name, "status": "unloaded" if gone else "unloading"}
    except (RuntimeLoRAError, ValueError) as e:     # (LoRAConfigError: a bad adapter, named)
        raise InvalidRequestError(str(e)) from None
