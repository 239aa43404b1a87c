"""Changes to a running engine through Triton: LoRA adapters loaded and unloaded (the
Triton side of vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`) and sleep
mode (vLLM's `/sleep`, `/wake_up`, `/is_sleeping`). The OpenAI frontend's routes call
this.

A request to the model whose request parameters carry `lora_action` or `sleep_action` is
a control request, not a generation:

    {"lora_action": "load", "lora_name": "sql", "lora_path": "/adapters/sql", "admin_key": "..."}
    {"lora_action": "unload", "lora_name": "sql", "admin_key": "..."}
    {"lora_action": "list"}
    {"sleep_action": "sleep", "level": 1, "admin_key": "..."}
    {"sleep_action": "wake_up", "admin_key": "..."}
    {"sleep_action": "is_sleeping"}

Its one response's `text_output` is a JSON object: `{"lora_name", "status": "loaded" |
"unloaded" | "unloading"}`; for `list` `{"loaded": [...], "unloading": [...]}`; for the
sleep actions `{"is_sleeping": bool, "level": 0 | 1 | 2}`.

Inference on Triton's ports takes no key, and these change what the server runs, so every
action but `list` and `is_sleeping` must carry the server's admin key (`admin_key`,
compared in constant time). That is the key of Triton's restricted APIs, which the
python stub reads from `TRITON_ADMIN_KEY` or the file `TRITON_ADMIN_KEY_FILE` names
(`make serve` sets it). A server started without one refuses every change.
"""

from __future__ import annotations

import hmac
import json
import os
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Optional

from backend.engine.errors import EngineBusyError, InvalidRequestError
from backend.lora.manager import RuntimeLoRAError

ACTIONS = {"lora_action": ("load", "unload", "list"), "sleep_action": ("sleep", "wake_up", "is_sleeping")}
READ_ONLY = ("list", "is_sleeping")
# supervisor/admin_access.py's names (the backend does not import the supervisor).
KEY_ENV, KEY_FILE_ENV = "TRITON_ADMIN_KEY", "TRITON_ADMIN_KEY_FILE"
TIMEOUT_S = 60.0
WAKE_UP_TIMEOUT_S = 600.0       # level 2 reads the weights again


class ControlRefused(InvalidRequestError):
    """A control request without the admin key, or on a server that has none."""


def control_of(request_parameters: str) -> Optional[dict]:
    """The request's control fields when it is a control request (it sets `lora_action`
    or `sleep_action`), else None. Malformed JSON is left to the sampling-parameter
    parser, which names it."""
    try:
        params = json.loads(request_parameters) if request_parameters and request_parameters.strip() else {}
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(params, dict):
        return None
    keys = [k for k in ACTIONS if k in params]
    if not keys:
        return None
    if len(keys) > 1:
        raise InvalidRequestError("a control request sets one of request parameters 'lora_action' and "
                                  "'sleep_action', not both")
    key = keys[0]
    if params[key] not in ACTIONS[key]:
        raise InvalidRequestError(f"request parameter '{key}' must be one of {', '.join(ACTIONS[key])}, "
                                  f"not {params[key]!r}")
    return {**params, "action": params[key]}


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
    action = params["action"]
    if server_key is None:
        raise ControlRefused(f"'{action}' changes what the server runs and needs the server's admin key, but this "
                             f"server has none ({KEY_ENV} or {KEY_FILE_ENV} in tritonserver's environment; "
                             "`make serve` sets it)")
    sent = params.get("admin_key")
    if not isinstance(sent, str) or not hmac.compare_digest(sent.encode(), server_key.encode()):
        raise ControlRefused(f"UNAUTHENTICATED: '{action}' needs request parameter 'admin_key' (the key of "
                             "Triton's restricted APIs)")


def run(loop, params: dict, server_key: Optional[str]) -> dict:
    """Carry out one control request on the engine loop (blocks until it is done: call it
    off Triton's execute thread). Raises an InvalidRequestError for the caller's mistakes."""
    action = params["action"]
    if action not in READ_ONLY:
        check_admin_key(params, server_key)
    try:
        if "sleep_action" in params:
            return _sleep_action(loop, action, params)
        return _lora_action(loop, action, params)
    except FutureTimeout:
        raise EngineBusyError(f"'{action}' is still in progress; it goes on (ask with sleep_action "
                              "'is_sleeping' or lora_action 'list')") from None
    except (RuntimeLoRAError, ValueError, OSError) as e:     # (LoRAConfigError: a bad adapter, named)
        raise InvalidRequestError(str(e)) from None


def answer_now(loop, params: dict) -> Optional[dict]:
    """A read-only action's answer, from the engine's state as it is (no wait for the
    engine thread, which may be busy waking up); None for a change."""
    if params["action"] == "list":
        return loop.engine.runtime_lora.listing()
    if params["action"] == "is_sleeping":
        mode = loop.engine.sleep_mode
        return {"is_sleeping": mode.is_sleeping, "level": mode.level}
    return None


def _lora_action(loop, action: str, params: dict) -> dict:
    if action == "list":
        return loop.engine.runtime_lora.listing()
    name = params.get("lora_name")
    if action == "load":
        loop.add_lora(name, params.get("lora_path")).result(TIMEOUT_S)
        return {"lora_name": name, "status": "loaded"}
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("'lora_name' must be a non-empty string")
    gone = loop.remove_lora(name).result(TIMEOUT_S)
    return {"lora_name": name, "status": "unloaded" if gone else "unloading"}


def _sleep_action(loop, action: str, params: dict) -> dict:
    mode = loop.engine.sleep_mode
    if action == "sleep":
        try:
            level = int(params.get("level", 1))
        except (TypeError, ValueError):
            raise InvalidRequestError(f"request parameter 'level' must be 1 or 2, not {params.get('level')!r}") \
                from None
        loop.call(lambda: mode.sleep(level)).result(WAKE_UP_TIMEOUT_S)
    elif action == "wake_up":
        loop.call(mode.wake_up).result(WAKE_UP_TIMEOUT_S)
    return {"is_sleeping": mode.is_sleeping, "level": mode.level}
