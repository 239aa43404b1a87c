"""The Triton side of runtime LoRA (backend/triton_server/lora_control.py): which
requests are control requests, and that a change needs the server's admin key."""

import json

import pytest

from backend.engine.errors import InvalidRequestError
from backend.triton_server import lora_control
from backend.triton_server.lora_control import ControlRefused, check_admin_key, control_of, server_admin_key

KEY = "server-admin-key-0123456789"


def test_control_requests_are_the_ones_with_lora_action():
    assert control_of("") is None and control_of('{"stop_key": "k"}') is None and control_of("{bad") is None
    assert control_of(json.dumps({"lora_action": "list"})) == {"lora_action": "list"}
    with pytest.raises(InvalidRequestError, match="must be one of load, unload, list, not 'drop'"):
        control_of(json.dumps({"lora_action": "drop"}))


def test_changes_need_the_servers_admin_key(tmp_path):
    load = {"lora_action": "load", "lora_name": "a", "lora_path": "/x"}
    with pytest.raises(ControlRefused, match="this server has none"):
        check_admin_key({**load, "admin_key": KEY}, None)
    for sent in (None, "", KEY[:-1], 12):
        with pytest.raises(ControlRefused, match="UNAUTHENTICATED"):
            check_admin_key({**load, "admin_key": sent}, KEY)
    check_admin_key({**load, "admin_key": KEY}, KEY)
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    assert server_admin_key({"TRITON_ADMIN_KEY_FILE": str(key_file)}) == KEY
    assert server_admin_key({"TRITON_ADMIN_KEY": KEY}) == KEY
    assert server_admin_key({}) is None and server_admin_key({"TRITON_ADMIN_KEY_FILE": "/nonexistent"}) is None


def test_list_is_open_and_a_refused_change_never_reaches_the_engine():
    class Loop:
        calls = []

        def list_loras(self):
            from concurrent.futures import Future
            f = Future()
            f.set_result({"loaded": ["a"], "unloading": []})
            return f

        def add_lora(self, *a):
            self.calls.append(a)

    loop = Loop()
    assert lora_control.run(loop, {"lora_action": "list"}, None) == {"loaded": ["a"], "unloading": []}
    with pytest.raises(ControlRefused):
        lora_control.run(loop, {"lora_action": "load", "lora_name": "b", "lora_path": "/b"}, KEY)
    assert loop.calls == []
