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


class _Final:
    bool_param = True


class _Result:
    """A Triton stream response carrying an embedding and the final-response flag."""

    def __init__(self) -> None:
        self.values = {"embedding": np.ones(4, dtype=np.float32), "num_input_tokens": np.array([3])}

    def as_numpy(self, name):
        return self.values.get(name)

    def get_response(self):
        return type("Response", (), {"parameters": {"triton_final_response": _Final()}})()


class _Call:
    """A gRPC stream that Triton ends a little after its final response; records when
    it ended and when it was cancelled."""

    def __init__(self, events: list, end_after_s: float = 0.05) -> None:
        self.events, self.end_after_s, self.answered = events, end_after_s, False

    def __aiter__(self):
        return self                                 # one stream, as tritonclient's iterator

    async def __anext__(self):
        if not self.answered:
            self.answered = True
            return _Result(), None
        await asyncio.sleep(self.end_after_s)       # the backend releasing the request
        self.events.append("ended")
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.events.append("cancelled")


class _Client:
    def __init__(self, events: list) -> None:
        self.events = events

    def stream_infer(self, requests):
        return _Call(self.events)


def test_an_answered_stream_is_left_to_triton_to_end_before_any_cancel():
    """A cancel right after the final response could overtake the backend's release of
    the request: Triton 24.10 then kept the model live and its shutdown waited out the
    30 s exit timeout (seen in CI: the embedding server's stop took 31 s in 3 of 5 runs)."""
    events = []
    vector, tokens = asyncio.run(embeddings._embed_one(_Client(events), "emb", [5, 6, 7]))
    assert vector.tolist() == [1.0] * 4 and tokens == 3
    assert events[0] == "ended", events


def test_a_sibling_cancelled_after_its_answer_still_lets_the_stream_end():
    """The first failure cancels the other inputs: one already answered waits for its
    stream's end (bounded), then takes the cancellation."""
    events = []

    async def scenario():
        task = asyncio.ensure_future(embeddings._embed_one(_Client(events), "emb", [5]))
        await asyncio.sleep(0.01)                   # answered; its stream not ended yet
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(scenario())
    assert events[0] == "ended", events
