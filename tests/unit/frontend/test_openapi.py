"""The frontend's /openapi.json (frontend/openai_api/schemas.py) against the app itself:
every route documented, request bodies from the models the routes parse with, the
error statuses in our shape; and the answers that need no tritonserver (strict JSON,
unknown routes and methods). The running server is fuzzed against this document in
tests/integration/test_api_fuzz.py."""

import jsonschema
import pytest
from fastapi.testclient import TestClient

from frontend.openai_api.app import create_app
from frontend.openai_api.auth import APIKeys
from frontend.openai_api.protocol import ChatCompletionRequest, CompletionRequest


def document(keys=()):
    return create_app("127.0.0.1:1", api_keys=APIKeys(keys)).openapi()


def resolve(doc, schema):
    """`schema` with the document's components, for jsonschema."""
    return {**schema, "components": doc["components"]}


def test_every_route_is_documented_with_its_body_and_error_statuses():
    doc = document(["key-1"])
    ops = {(path, method): op for path, item in doc["paths"].items() for method, op in item.items()}
    assert set(ops) == {("/health", "get"), ("/v1/models", "get"), ("/v1/completions", "post"),
                        ("/v1/chat/completions", "post"), ("/v1/models/{model_id}", "get"), ("/tokenize", "post"),
                        ("/detokenize", "post"), ("/metrics", "get"), ("/v1/embeddings", "post")}
    for (path, method), op in ops.items():
        if method == "post":
            assert op["requestBody"]["required"] and {"400", "401", "413"} <= set(op["responses"])
        if path.endswith("completions"):
            assert op["requestBody"]["required"] and set(op["responses"]) == {"200", "400", "401", "404", "413",
                                                                              "500", "503", "504"}
            assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
        assert ("security" in op) == (path.startswith("/v1") or path in ("/tokenize", "/detokenize"))
    for name, cls in (("CompletionRequest", CompletionRequest), ("ChatCompletionRequest", ChatCompletionRequest)):
        assert doc["components"]["schemas"][name]["properties"].keys() == cls.model_json_schema()["properties"].keys()
    # without keys, nothing asks for one
    assert all("401" not in op["responses"] and "security" not in op
               for item in document()["paths"].values() for op in item.values())


@pytest.mark.parametrize("body, valid", [
    ({"model": "m", "prompt": "a"}, True),
    ({"model": "m", "prompt": [1, 2]}, True),
    ({"model": "m", "prompt": ["a", "b"]}, False),          # one prompt per request
    ({"model": "m", "prompt": ""}, False),
    ({"model": "m", "prompt": [2**31]}, False),
    ({"model": "m", "prompt": "a", "echo": True}, False),
    ({"model": "m", "prompt": "a", "logit_bias": {"x": 1}}, False),
    ({"model": "m", "prompt": "a", "logit_bias": {"7": 101}}, False),
    ({"model": "m", "prompt": "a", "stop": ["a", ""]}, False),
    ({"model": "m", "prompt": "a", "unknown": 1}, True),    # ignored, as OpenAI does
])
def test_the_declared_request_schema_follows_the_validators(body, valid):
    doc = document()
    schema = resolve(doc, {"$ref": "#/components/schemas/CompletionRequest"})
    assert jsonschema.Draft202012Validator(schema).is_valid(body) == valid


def test_the_error_schemas_fix_code_and_type():
    doc = document(["key-1"])
    schema = doc["paths"]["/v1/completions"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    error = {"error": {"message": "m", "type": "BadRequestError", "param": None, "code": 400}}
    assert jsonschema.Draft202012Validator(resolve(doc, schema)).is_valid(error)
    assert not jsonschema.Draft202012Validator(resolve(doc, schema)).is_valid({"error": {**error["error"], "code": 404}})


@pytest.fixture
def client():
    with TestClient(create_app("127.0.0.1:1", api_keys=APIKeys(["key-1"]))) as c:
        yield c


@pytest.mark.parametrize("body", [b'{"model": "m", "prompt": "a", "temperature": NaN}',
                                  b'{"model": "m", "prompt": "a", "logit_bias": {"5": Infinity}}',
                                  b'{"model": "m", "prompt": "\\ud800"}',            # was a 500
                                  b'{"model": "m", "messages": [{"role": "\\udfff", "content": "x"}]}'])
def test_bodies_must_be_strict_json(client, body):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    r = client.post(path, content=body, headers={"authorization": "Bearer key-1"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_a_surrogate_pair_is_a_character(client):
    r = client.post("/v1/completions", content=b'{"model": "m", "prompt": "\\ud83d\\ude00"}',
                    headers={"authorization": "Bearer key-1"})
    assert r.status_code == 503      # past the body: no tritonserver here


def test_unknown_routes_and_methods_answer_in_our_error_shape(client):
    r = client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = client.get("/v1/completions", headers={"authorization": "Bearer key-1"})
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["code"] == 405
