"""Changes to a running engine through Triton (backend/triton_server/engine_control.py):
which requests are control requests, that a change needs the server's admin key, and
sleep mode on a real engine loop."""

import json
from types import SimpleNamespace

import pytest

from backend.engine.errors import InvalidRequestError
from backend.triton_server import engine_control
from backend.triton_server.engine_control import ControlRefused, check_admin_key, control_of, server_admin_key

KEY = "server-admin-key-0123456789"


def test_control_requests_are_the_ones_with_an_action():
    assert control_of("") is None and control_of('{"stop_key": "k"}') is None and control_of("{bad") is None
    assert control_of(json.dumps({"lora_action": "list"}))["action"] == "list"
    assert control_of(json.dumps({"sleep_action": "sleep", "level": 2}))["action"] == "sleep"
    with pytest.raises(InvalidRequestError, match="must be one of load, unload, list, not 'drop'"):
        control_of(json.dumps({"lora_action": "drop"}))
    with pytest.raises(InvalidRequestError, match="not both"):
        control_of(json.dumps({"lora_action": "list", "sleep_action": "is_sleeping"}))


def test_changes_need_the_servers_admin_key(tmp_path):
    load = {"action": "load", "lora_name": "a", "lora_path": "/x"}
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


def test_read_only_actions_are_open_and_a_refused_change_never_reaches_the_engine():
    class Loop:
        calls = []
        # (read-only actions read the engine's state directly, not through its thread)
        engine = SimpleNamespace(runtime_lora=SimpleNamespace(listing=lambda: {"loaded": ["a"], "unloading": []}))

        def add_lora(self, *a):
            self.calls.append(a)

        def call(self, fn):
            self.calls.append(fn)

    loop = Loop()
    assert engine_control.run(loop, control_of('{"lora_action": "list"}'), None) == {"loaded": ["a"],
                                                                                      "unloading": []}
    for body in ({"lora_action": "load", "lora_name": "b", "lora_path": "/b"}, {"sleep_action": "sleep"},
                 {"sleep_action": "wake_up", "admin_key": "wrong"}):
        with pytest.raises(ControlRefused):
            engine_control.run(loop, control_of(json.dumps(body)), KEY)
    assert loop.calls == []


def test_sleep_actions_on_an_engine_loop(ckpt_dir):
    from backend import LLM
    from backend.engine.engine_loop import EngineLoop
    from tests.helpers.checkpoints import make_checkpoint
    llm = LLM(make_checkpoint(str(ckpt_dir / "llama"), "llama"), block_size=4, num_kv_blocks=16)
    loop = EngineLoop(llm.engine).start()
    try:
        run = lambda body: engine_control.run(loop, control_of(json.dumps({**body, "admin_key": KEY})), KEY)  # noqa
        assert run({"sleep_action": "sleep", "level": 2}) == {"is_sleeping": True, "level": 2}
        assert run({"sleep_action": "is_sleeping"}) == {"is_sleeping": True, "level": 2}
        with pytest.raises(InvalidRequestError, match="asleep already"):
            run({"sleep_action": "sleep"})
        with pytest.raises(InvalidRequestError, match="'level' must be 1 or 2"):
            run({"sleep_action": "sleep", "level": "deep"})
        assert run({"sleep_action": "wake_up"}) == {"is_sleeping": False, "level": 0}
        assert engine_control.answer_now(loop, control_of('{"sleep_action": "is_sleeping"}'))["level"] == 0
        assert engine_control.answer_now(loop, control_of('{"sleep_action": "sleep"}')) is None
    finally:
        loop.stop()
