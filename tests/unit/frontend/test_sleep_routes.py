"""vLLM's `/sleep`, `/wake_up` and `/is_sleeping` without a tritonserver (the models'
control requests faked): the admin key is needed, API keys or not; each base model gets
the action, or the one `?model=` names. tests/integration/test_sleep_mode.py runs them
against the real server."""

import pytest
from fastapi.testclient import TestClient

from frontend.openai_api import engine_control
from frontend.openai_api.app import create_app
from frontend.openai_api.auth import APIKeys
from frontend.openai_api.triton_client import ServedModel
from tests.helpers.fake_triton import FakeTriton

ADMIN = "admin-key-0123456789abcdef"
MODELS = {"llm": ServedModel("llm", None, 0, "llm"), "emb": ServedModel("emb", None, 0, "emb", runner="pooling"),
          "sql": ServedModel("sql", None, 0, "llm", "sql")}


@pytest.fixture
def sent(monkeypatch):
    calls = []

    async def control(client, model, params):
        calls.append((model, params))
        return {"is_sleeping": params.get("sleep_action") == "sleep", "level": params.get("level", 0)}
    monkeypatch.setattr(engine_control, "control", control)
    return calls


def app(admin=ADMIN, api_keys=("key-1",)):
    client = TestClient(create_app("127.0.0.1:1", api_keys=APIKeys(api_keys),
                                   admin_headers={"triton-grpc-protocol-admin-key": admin} if admin else None))
    client.__enter__()
    client.app.state.llm = FakeTriton(MODELS)
    return client


def test_the_admin_key_is_needed_even_with_the_api_key(sent):
    c = app()
    assert c.post("/sleep", headers={"authorization": "Bearer key-1"}).status_code == 401
    assert c.post("/sleep", headers={"admin-key": "wrong"}).status_code == 401
    assert c.get("/is_sleeping").status_code == 401
    assert sent == []
    r = app(admin=None).post("/sleep", headers={"admin-key": ADMIN})
    assert r.status_code == 403 and sent == []


def test_every_base_model_or_the_one_named(sent):
    c = app()
    assert c.post("/sleep?level=2", headers={"admin-key": ADMIN}).status_code == 200
    assert [(m, p["level"]) for m, p in sent] == [("llm", 2), ("emb", 2)]          # not the adapter
    assert all(p["admin_key"] == ADMIN for _, p in sent)
    sent.clear()
    assert c.post("/wake_up?model=emb", headers={"admin-key": ADMIN}).status_code == 200
    assert [(m, p["sleep_action"]) for m, p in sent] == [("emb", "wake_up")]
    assert c.get("/is_sleeping", headers={"admin-key": ADMIN}).json() == {"is_sleeping": False}
    r = c.post("/sleep?level=3", headers={"admin-key": ADMIN})
    assert r.status_code == 400 and r.json()["error"]["param"] == "level"
    assert c.post("/sleep?model=nope", headers={"admin-key": ADMIN}).status_code == 404
