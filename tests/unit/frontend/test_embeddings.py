"""/v1/embeddings with several inputs, the served model faked: they run concurrently, the
first failure is the response, and it cancels the inputs still running (nothing keeps
going for a request that has already failed)."""

import asyncio

import numpy as np
import pytest
from fastapi.testclient import TestClient

from frontend.openai_api import embeddings
from frontend.openai_api.app import create_app
from frontend.openai_api.auth import APIKeys
from frontend.openai_api.errors import APIError
from frontend.openai_api.triton_client import ServedModel
from tests.helpers.fake_triton import FakeTriton

KEY = {"authorization": "Bearer key-1"}


@pytest.fixture
def client(tiny_ckpt):
    with TestClient(create_app("127.0.0.1:1", api_keys=APIKeys(["key-1"]))) as c:
        c.app.state.llm = FakeTriton({"emb": ServedModel("emb", tiny_ckpt, 9, "emb", runner="pooling")})
        yield c


def test_the_first_failure_is_the_answer_and_cancels_the_rest(client, monkeypatch):
    cancelled = []

    async def embed_one(_client, _model, prompt):
        if prompt == "bad":
            await asyncio.sleep(0.05)
            raise APIError(400, "input 'bad' refused", "input")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(prompt)
            raise
        return np.zeros(4, dtype=np.float32), 1
    monkeypatch.setattr(embeddings, "_embed_one", embed_one)
    r = client.post("/v1/embeddings", json={"model": "emb", "input": ["one", "bad", "two"]}, headers=KEY)
    assert r.status_code == 400 and r.json()["error"]["message"] == "input 'bad' refused"
    assert sorted(cancelled) == ["one", "two"]


def test_all_inputs_answer_in_order(client, monkeypatch):
    async def embed_one(_client, _model, prompt):
        await asyncio.sleep(0.01 * (3 - len(prompt)))                 # the last input finishes first
        return np.full(2, len(prompt), dtype=np.float32), len(prompt)
    monkeypatch.setattr(embeddings, "_embed_one", embed_one)
    r = client.post("/v1/embeddings", json={"model": "emb", "input": ["a", "bb", "ccc"]}, headers=KEY)
    assert r.status_code == 200
    assert [d["embedding"] for d in r.json()["data"]] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
    assert r.json()["usage"]["prompt_tokens"] == 6


def test_the_official_client_may_pass_none_for_every_optional_argument(client, monkeypatch):
    """openai-python sends an argument passed as None as an explicit null; a null
    `encoding_format` was a 400 (issue 49's real clients)."""
    import openai

    async def embed_one(_client, _model, prompt):
        return np.full(2, 0.5, dtype=np.float32), 1
    monkeypatch.setattr(embeddings, "_embed_one", embed_one)
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="key-1", http_client=client, max_retries=0)
    reply = oai.embeddings.create(model="emb", input="hi", encoding_format=None, dimensions=None, user=None)
    assert reply.data[0].embedding == [0.5, 0.5]
    r = client.post("/v1/embeddings", json={"model": "emb", "input": "hi", "encoding_format": None,
                                             "dimensions": None, "user": None}, headers=KEY)
    assert r.status_code == 200 and r.json()["data"][0]["embedding"] == [0.5, 0.5]
