"""The frontend's smaller routes without a tritonserver (the served models faked):
GET /v1/models/{id}, /tokenize and /detokenize in vLLM's shapes with the model's own
tokenizer and chat template, and /metrics. tests/integration/test_openai_routes.py runs
them against the real server."""

import re

import pytest
from fastapi.testclient import TestClient

from frontend.openai_api.app import create_app
from frontend.openai_api.auth import APIKeys
from frontend.openai_api.chat import ChatTemplates
from frontend.openai_api.triton_client import ServedModel
from tests.helpers.fake_triton import FakeTriton
from tests.helpers.probing import post_while_probing

KEY = {"authorization": "Bearer key-1"}
MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]


@pytest.fixture
def client(tiny_ckpt):
    with TestClient(create_app("127.0.0.1:1", api_keys=APIKeys(["key-1"]))) as c:
        c.app.state.llm = FakeTriton({"llm": ServedModel("llm", tiny_ckpt, 7, "llm", max_model_len=1024),
                                      "org/other": ServedModel("org/other", None, 8, "org/other"),
                                      "emb": ServedModel("emb", tiny_ckpt, 9, "emb", runner="pooling")})
        yield c


@pytest.fixture
def tok(tiny_ckpt):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_ckpt)


def test_retrieve_a_model_or_an_openai_404(client):
    r = client.get("/v1/models/llm", headers=KEY)
    assert r.status_code == 200 and r.json() == {"id": "llm", "object": "model", "created": 7, "owned_by": "paged_llm",
                                                 "root": "llm", "parent": None}
    assert client.get("/v1/models/org/other", headers=KEY).json()["id"] == "org/other"     # ids with a slash
    r = client.get("/v1/models/nope", headers=KEY)
    assert r.status_code == 404 and r.json()["error"] == {"message": "The model 'nope' does not exist",
                                                          "type": "NotFoundError", "param": "model", "code": 404}
    assert client.get("/v1/models/llm").status_code == 401


def test_tokenize_a_prompt_and_detokenize_it_back(client, tok):
    text = "The pass statement does nothing."
    r = client.post("/tokenize", json={"model": "llm", "prompt": text}, headers=KEY)
    want = tok(text)["input_ids"]          # (this tokenizer adds no BOS of its own)
    assert r.status_code == 200 and r.json() == {"count": len(want), "max_model_len": 1024, "tokens": want}
    r = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True},
                    headers=KEY)                                            # model: the first served one
    assert r.json()["tokens"] == want and r.json()["token_strs"] == tok.convert_ids_to_tokens(want)
    r = client.post("/detokenize", json={"model": "llm", "tokens": want}, headers=KEY)
    assert r.status_code == 200 and r.json() == {"prompt": text}


def test_tokenize_a_chat_with_the_template(client, tok, tiny_ckpt):
    r = client.post("/tokenize", json={"model": "llm", "messages": MESSAGES}, headers=KEY)
    assert r.json()["tokens"] == ChatTemplates().render(tiny_ckpt, "llm", MESSAGES)[1]    # what chat sends
    r = client.post("/tokenize", json={"model": "llm", "messages": MESSAGES, "add_generation_prompt": False},
                    headers=KEY)
    assert tok.decode(r.json()["tokens"]) == "<s>system: Be terse.\nuser: hi\n"


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"model": "llm", "messages": MESSAGES, "continue_final_message": True}, None),
    ("/tokenize", {"model": "llm"}, "prompt"),
    ("/tokenize", {"model": "llm", "prompt": 5}, "prompt"),
    ("/tokenize", {"model": "org/other", "prompt": "x"}, "model"),     # no checkpoint on this machine
    ("/detokenize", {"model": "llm", "tokens": [1, 10 ** 6]}, "tokens"),
    ("/detokenize", {"model": "llm", "tokens": [-1]}, "tokens.0"),
])
def test_bad_tokenize_requests_are_400s_naming_the_field(client, path, body, param):
    r = client.post(path, json=body, headers=KEY)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()


def test_tokenize_needs_the_key_and_knows_the_model(client):
    assert client.post("/tokenize", json={"model": "llm", "prompt": "x"}).status_code == 401
    assert client.post("/detokenize", json={"model": "llm", "tokens": [5]}).status_code == 401
    assert client.post("/tokenize", json={"model": "nope", "prompt": "x"}, headers=KEY).status_code == 404


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"model": "llm", "input": "x"}, "model"),             # a generative model
    ("/v1/embeddings", {"model": "emb", "input": "x", "dimensions": 8}, "dimensions"),
    ("/v1/embeddings", {"model": "emb", "input": ""}, "input"),
    ("/v1/embeddings", {"model": "emb", "input": []}, "input"),
    ("/v1/embeddings", {"model": "emb", "input": ["a", ""]}, "input"),
    ("/v1/embeddings", {"model": "emb", "input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/completions", {"model": "emb", "prompt": "x"}, "model"),          # an embedding model
    ("/v1/chat/completions", {"model": "emb", "messages": MESSAGES}, "model"),
])
def test_embeddings_and_generation_refuse_each_others_models(client, path, body, param):
    r = client.post(path, json=body, headers=KEY)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()


def sample(text: str, name: str, **labels) -> float:
    for m in re.finditer(rf"^{name}\{{(.*)\}} (\S+)$", text, re.M):
        if dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) == labels:
            return float(m.group(2))
    raise AssertionError(f"{name}{labels} not in the metrics")


def test_metrics_count_requests_by_route_and_status_without_a_key(client):
    client.get("/v1/models/llm", headers=KEY)
    client.get("/v1/models/nope", headers=KEY)
    client.get("/v1/models/nope2", headers=KEY)
    client.get("/v1/models/llm")
    client.get("/no/such/route")
    r = client.get("/metrics")                                # no key needed
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    route = "/v1/models/{model_id:path}"
    assert sample(r.text, "http_requests_total", handler=route, method="GET", status="200") == 1
    assert sample(r.text, "http_requests_total", handler=route, method="GET", status="404") == 2
    assert sample(r.text, "http_requests_total", handler=route, method="GET", status="401") == 1
    assert sample(r.text, "http_requests_total", handler="unmatched", method="GET", status="404") == 1
    assert sample(r.text, "http_request_duration_seconds_count", handler=route, method="GET", status="404") == 2
    assert "nope" not in r.text                                 # the template, never the path


def test_tokenize_refuses_a_prompt_past_max_model_len_without_tokenizing_it_whole(client, monkeypatch):
    """A 16 MB prompt was tokenized whole (22 s of the frontend's CPU, 8.1M ids). Now it
    is refused (as generation would refuse it) after about max_model_len tokens of it."""
    from backend.engine import prompt_length
    seen = []
    real = prompt_length.tokenize_within

    def counting(tokenize, text, max_model_len):
        return real(lambda t: (seen.append(len(t)), tokenize(t))[1], text, max_model_len)

    monkeypatch.setattr("frontend.openai_api.tokenization.tokenize_within", counting)
    r = client.post("/tokenize", json={"model": "llm", "prompt": "word " * 400_000}, headers=KEY)   # 2 MB
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "max_model_len" in r.text
    assert sum(seen) <= 4 * prompt_length.CHUNK_CHARS
    r = client.post("/tokenize", json={"model": "llm", "messages": [{"role": "user", "content": "word " * 400_000}]},
                    headers=KEY)
    assert r.status_code == 400 and "max_model_len" in r.text
    assert client.post("/tokenize", json={"model": "llm", "prompt": "word " * 100}, headers=KEY).json()["count"] > 100


@pytest.mark.parametrize("route, body", [
    ("/tokenize", {"model": "llm", "prompt": "word " * (3 << 20)}),
    ("/v1/completions", {"model": "llm", "prompt": "word " * (3 << 20), "echo": True, "logprobs": 1,
                         "max_tokens": 0})])
def test_a_15_mib_prompt_is_refused_while_other_requests_are_answered(client, route, body):
    """Issue 49 item 11: `/tokenize` and `echo` with logprobs tokenized a 16 MB prompt whole
    (22 s of the frontend's CPU). With the model's own tokenizer, a 15 MiB prompt is a 400
    in well under the old time, while normal requests sent meanwhile are answered."""
    import json
    r, elapsed, waits = post_while_probing(client, route, json.dumps(body).encode(), KEY)
    assert r.status_code == 400 and "max_model_len" in r.text, r.text
    assert elapsed < 3.0, elapsed                       # (was 22 s of CPU; a wide margin)
    assert max(waits) < 1.0, waits
