"""API keys of the OpenAI frontend (frontend/openai_api/auth.py), and the app's checks:
which routes need a key, the 401 body, and the request-body limit; the Triton side is
not reached (no tritonserver here: tests/integration/test_security.py has the real one)."""

import pytest
from fastapi.testclient import TestClient

from frontend.openai_api.app import create_app
from frontend.openai_api.auth import APIKeys


def test_keys_from_every_source(tmp_path):
    f = tmp_path / "keys"
    f.write_text("file-a\n\nfile-b\n")
    keys = APIKeys.from_sources(["cli-a,cli-b"], {"API_KEY": "env-a, env-b", "API_KEY_FILE": str(f)})
    for k in ("cli-a", "cli-b", "env-a", "env-b", "file-a", "file-b"):
        assert keys.allows(f"Bearer {k}"), k
    assert not APIKeys.from_sources([], {}) and APIKeys(["x"])


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Bearer wrong", "Basic key-1", "key-1",
                                    "Bearer key-1x", "Bearer key-"])
def test_refused(header):
    assert not APIKeys(["key-1", "key-2"]).allows(header)


def test_scheme_is_case_insensitive_as_in_http():
    assert APIKeys(["key-1"]).allows("bearer key-1") and APIKeys(["key-1"]).allows("BEARER  key-1 ")


@pytest.fixture
def client():
    app = create_app("127.0.0.1:1", api_keys=APIKeys(["key-1"]), max_request_body_bytes=64)
    with TestClient(app) as c:
        yield c


def test_v1_routes_need_the_key_and_say_so_as_openai_does(client):
    for method, path in (("get", "/v1/models"), ("post", "/v1/completions"), ("post", "/v1/chat/completions"),
                         ("get", "/v1/nonexistent"), ("get", "/v1")):
        r = getattr(client, method)(path)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
        error = r.json()["error"]
        assert error == {"message": error["message"], "type": "AuthenticationError", "param": None, "code": 401}
        assert "Missing API key" in error["message"]
    r = client.get("/v1/models", headers={"authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["message"] == "Incorrect API key provided"


def test_open_routes(client):
    assert client.get("/openapi.json").status_code == 200
    assert client.get("/health").status_code == 503       # open, and honest: no tritonserver here


def test_body_over_the_limit_is_413_naming_it(client):
    r = client.post("/v1/completions", content=b"{" + b" " * 100 + b"}",
                    headers={"authorization": "Bearer key-1", "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["param"] == "max_request_body_bytes"
    r = client.post("/v1/completions", content=iter([b"{", b" " * 100, b"}"]),     # chunked: no length given
                    headers={"authorization": "Bearer key-1", "content-type": "application/json"})
    assert r.status_code == 413
    r = client.post("/v1/completions", content=b"[]", headers={"authorization": "Bearer key-1"})
    assert r.status_code == 400                          # under the limit: on to the next check
