"""The frontend's /openapi.json (frontend/openai_api/schemas.py) against the app itself:
every route documented, request bodies from the models the routes parse with, the
error statuses in our shape; and the answers that need no tritonserver (strict JSON,
unknown routes and methods). The running server is fuzzed against this document in
tests/integration/test_api_fuzz.py."""

import json

import jsonschema
import pytest
from fastapi.testclient import TestClient

from frontend.openai_api.app import create_app
from frontend.openai_api.auth import APIKeys
from frontend.openai_api.schemas import ADMIN_ROUTES
from frontend.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from frontend.openai_api.responses_protocol import ResponsesRequest


def document(keys=()):
    return create_app("127.0.0.1:1", api_keys=APIKeys(keys)).openapi()


def resolve(doc, schema):
    """`schema` with the document's components, for jsonschema."""
    return {**schema, "components": doc["components"]}


def test_every_route_is_documented_with_its_body_and_error_statuses():
    doc = document(["key-1"])
    ops = {(path, method): op for path, item in doc["paths"].items() for method, op in item.items()}
    assert set(ops) == {("/health", "get"), ("/health/ready", "get"), ("/v1/models", "get"), ("/v1/completions", "post"),
                        ("/v1/chat/completions", "post"), ("/v1/responses", "post"),
                        ("/v1/responses/{response_id}", "get"), ("/v1/models/{model_id}", "get"), ("/tokenize", "post"),
                        ("/detokenize", "post"), ("/metrics", "get"), ("/v1/embeddings", "post"),
                        ("/v1/load_lora_adapter", "post"), ("/v1/unload_lora_adapter", "post"),
                        ("/sleep", "post"), ("/wake_up", "post"), ("/is_sleeping", "get")}
    for (path, method), op in ops.items():
        if method == "post" and path not in ("/sleep", "/wake_up"):      # (those two take no body)
            assert op["requestBody"]["required"] and {"400", "401", "413"} <= set(op["responses"])
        if path.endswith("completions"):
            assert op["requestBody"]["required"] and set(op["responses"]) == {"200", "400", "401", "404", "413",
                                                                              "500", "503", "504"}
            assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
        assert ("security" in op) == (path.startswith("/v1") or path in ("/tokenize", "/detokenize"))
    for name, cls in (("CompletionRequest", CompletionRequest), ("ChatCompletionRequest", ChatCompletionRequest),
                      ("ResponsesRequest", ResponsesRequest)):
        assert doc["components"]["schemas"][name]["properties"].keys() == cls.model_json_schema()["properties"].keys()
    # without keys, nothing asks for one (the LoRA routes take the admin key then: a 401 without it)
    assert all(("401" in op["responses"]) == (path in ADMIN_ROUTES) and "security" not in op
               for path, item in document()["paths"].items() for op in item.values())


@pytest.mark.parametrize("body, valid", [
    ({"model": "m", "prompt": "a"}, True),
    ({"model": "m", "prompt": [1, 2]}, True),
    ({"model": "m", "prompt": ["a", "b"]}, True),           # a choice set per prompt
    ({"model": "m", "prompt": [[1, 2], [3]]}, True),
    ({"model": "m", "prompt": []}, False),
    ({"model": "m", "prompt": [[]]}, False),
    ({"model": "m", "prompt": ""}, False),
    ({"model": "m", "prompt": [2**31]}, False),
    ({"model": "m", "prompt": "a", "echo": True, "max_tokens": 0, "logprobs": 0}, True),
    ({"model": "m", "prompt": "a", "suffix": "b"}, False),
    ({"model": "m", "prompt": "a", "prompt_logprobs": -1}, False),
    ({"model": "m", "prompt": "a", "logit_bias": {"x": 1}}, False),
    ({"model": "m", "prompt": "a", "logit_bias": {"7": 101}}, False),
    ({"model": "m", "prompt": "a", "stop": ["a", ""]}, False),
    ({"model": "m", "prompt": "a", "unknown": 1}, True),    # ignored, as OpenAI does
    ({"model": "m", "prompt": "a", "stream_options": {"include_usage": True}}, False),
    ({"model": "m", "prompt": "a", "stream": True, "stream_options": {"include_usage": True}}, True),
    ({"model": "m", "prompt": "a", "stream_options": None}, True),
])
def test_the_declared_request_schema_follows_the_validators(body, valid):
    doc = document()
    schema = resolve(doc, {"$ref": "#/components/schemas/CompletionRequest"})
    assert jsonschema.Draft202012Validator(schema).is_valid(body) == valid


@pytest.mark.parametrize("message, valid", [
    ({"role": "user", "content": "x"}, True),
    ({"role": "assistant", "content": None}, True),
    ({"role": "user", "content": None}, False),
    ({"role": "tool"}, False),
    ({"role": "wizard", "content": "x"}, False),
    ({"role": "user", "content": [{"type": "text", "text": "x"}]}, True),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}, True),
    ({"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}, False),
])
def test_the_declared_message_schema_follows_the_validators(message, valid):
    doc = document()
    schema = resolve(doc, {"$ref": "#/components/schemas/ChatCompletionRequest"})
    body = {"model": "m", "messages": [message]}
    assert jsonschema.Draft202012Validator(schema).is_valid(body) == valid
    try:
        ChatCompletionRequest.model_validate(body)
        assert valid
    except ValueError:
        assert not valid


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


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("body", [
    b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",        # json.loads: RecursionError
    json.dumps({"model": "m", "prompt": "a", "guided_json": _nested(500)}).encode(),  # json.dumps on the way out
    json.dumps({"model": "m", "prompt": "a", "response_format": {"type": "json_schema", "json_schema": {
        "name": "deep", "schema": _nested(500)}}}).encode(),
])
def test_deeply_nested_bodies_are_a_400_not_a_500(client, body):
    r = client.post("/v1/completions", content=body, headers={"authorization": "Bearer key-1"})
    assert r.status_code == 400 and "levels deep" in r.json()["error"]["message"]


def test_nesting_is_counted_outside_strings_only(client):
    """Brackets inside a string nest nothing; a schema a few dozen levels deep passes."""
    for body in ({"model": "m", "prompt": "[{" * 50_000}, {"model": "m", "prompt": "a", "guided_json": _nested(60)}):
        r = client.post("/v1/completions", json=body, headers={"authorization": "Bearer key-1"})
        assert r.status_code == 503      # past the body: no tritonserver here


def test_a_surrogate_pair_is_a_character(client):
    r = client.post("/v1/completions", content=b'{"model": "m", "prompt": "\\ud83d\\ude00"}',
                    headers={"authorization": "Bearer key-1"})
    assert r.status_code == 503      # past the body: no tritonserver here


def test_unknown_routes_and_methods_answer_in_our_error_shape(client):
    r = client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = client.get("/v1/completions", headers={"authorization": "Bearer key-1"})
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["code"] == 405
