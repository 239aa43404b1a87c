"""`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` without a tritonserver (the
model's control request faked): who may call them, which model gets the change, and
vLLM's answers. tests/integration/test_lora_serving.py runs them against the real server."""

import pytest
from fastapi.testclient import TestClient

from frontend.openai_api import engine_control
from frontend.openai_api.app import create_app
from frontend.openai_api.auth import APIKeys
from frontend.openai_api.errors import APIError
from frontend.openai_api.triton_client import ServedModel
from tests.helpers.fake_triton import FakeTriton

ADMIN = "admin-key-0123456789abcdef"
LOAD = {"lora_name": "sql", "lora_path": "/adapters/sql"}


class Triton(FakeTriton):
    forgotten = 0

    def forget_models(self):
        self.forgotten += 1


@pytest.fixture
def sent(monkeypatch):
    calls = []

    async def control(client, model, params):
        calls.append((model, params))
        if params["lora_name"] == "gone":
            raise APIError(400, "The lora adapter 'gone' cannot be found.")
        return {"lora_name": params["lora_name"], "status": "unloading" if params["lora_name"] == "busy" else "loaded"}
    monkeypatch.setattr(engine_control, "control", control)
    return calls


def app(api_keys=(), admin=ADMIN, models=None):
    client = TestClient(create_app("127.0.0.1:1", api_keys=APIKeys(api_keys),
                                   admin_headers={"triton-grpc-protocol-admin-key": admin} if admin else None))
    client.__enter__()
    client.app.state.llm = Triton(models or {"llm": ServedModel("llm", None, 0, "llm", lora_enabled=True),
                                             "plain": ServedModel("plain", None, 0, "plain")})
    return client


def test_without_api_keys_the_admin_key_header_is_needed(sent):
    c = app()
    assert c.post("/v1/load_lora_adapter", json=LOAD).status_code == 401
    assert c.post("/v1/load_lora_adapter", json=LOAD, headers={"admin-key": "wrong"}).status_code == 401
    r = c.post("/v1/load_lora_adapter", json=LOAD, headers={"admin-key": ADMIN})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."
    assert sent == [("llm", {"lora_action": "load", "lora_name": "sql", "lora_path": "/adapters/sql",
                             "admin_key": ADMIN})]
    assert c.app.state.llm.forgotten == 1               # /v1/models shows it at once
    none = app(admin=None)
    r = none.post("/v1/load_lora_adapter", json=LOAD, headers={"admin-key": ADMIN})
    assert r.status_code == 403 and "this frontend has none" in r.json()["error"]["message"]
    assert len(sent) == 1


def test_with_api_keys_the_api_key_is_enough(sent):
    c = app(api_keys=["key-1"])
    assert c.post("/v1/load_lora_adapter", json=LOAD, headers={"admin-key": ADMIN}).status_code == 401
    ok = c.post("/v1/unload_lora_adapter", json={"lora_name": "busy"}, headers={"authorization": "Bearer key-1"})
    assert ok.status_code == 200
    assert ok.text == "Success: LoRA adapter 'busy' removed successfully. It is dropped once its running requests finish."
    r = c.post("/v1/unload_lora_adapter", json={"lora_name": "gone"}, headers={"authorization": "Bearer key-1"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


def test_which_model_gets_the_adapter(sent):
    headers = {"admin-key": ADMIN}
    r = app().post("/v1/load_lora_adapter", json={**LOAD, "model": "plain"}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    both = app(models={m: ServedModel(m, None, 0, m, lora_enabled=True) for m in ("a", "b")})
    r = both.post("/v1/load_lora_adapter", json=LOAD, headers=headers)
    assert r.status_code == 400 and "several models take LoRA adapters (a, b)" in r.json()["error"]["message"]
    assert both.post("/v1/load_lora_adapter", json={**LOAD, "model": "b"}, headers=headers).status_code == 200
    assert sent[-1][0] == "b"
    none = app(models={"plain": ServedModel("plain", None, 0, "plain")})
    r = none.post("/v1/load_lora_adapter", json=LOAD, headers=headers)
    assert r.status_code == 400 and "enable_lora" in r.json()["error"]["message"]
    bad = app().post("/v1/load_lora_adapter", json={"lora_name": "x"}, headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
