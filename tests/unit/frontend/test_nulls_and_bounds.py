"""Requests real clients send, through the app with Triton faked (no server): explicit
JSON nulls for optional fields (what the official openai client sends for an argument
passed as None) mean "not given" (frontend/openai_api/nulls.py); counts past INT32, an
empty prompt and best_of are 400s naming the field."""

import inspect

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from frontend.openai_api.app import create_app
from frontend.openai_api.auth import APIKeys
from frontend.openai_api.triton_client import Delta, ServedModel
from tests.helpers.fake_triton import FakeTriton
from tests.helpers.probing import post_while_probing

KEY = {"authorization": "Bearer key-1"}
MESSAGES = [{"role": "user", "content": "hi"}]


class FakeGeneration:
    """One Triton request that answers "Hello." and stops."""

    def __init__(self, n: int) -> None:
        self.n = n

    def cancel(self) -> None:
        pass

    async def __aiter__(self):
        for i in range(self.n):
            yield Delta(i, "Hello.", [5, 6], "stop", [], 3)


class GeneratingTriton(FakeTriton):
    def __init__(self, models):
        super().__init__(models)
        self.sent: list[dict] = []          # the sampling parameters of each request

    def generate(self, model, prompt, sampling, stream, logprobs, images=None):
        self.sent.append(sampling)
        return FakeGeneration(int(sampling.get("n", 1)))


@pytest.fixture
def client(tiny_ckpt):
    with TestClient(create_app("127.0.0.1:1", api_keys=APIKeys(["key-1"]))) as c:
        c.app.state.llm = GeneratingTriton({"llm": ServedModel("llm", tiny_ckpt, 7, "llm", max_model_len=1024)})
        yield c


def _nones(method, given: dict) -> dict:
    """Every argument of an openai client method that it lets one leave out, as None
    (request options such as timeout and extra_body aside), with `given`."""
    options = {"extra_headers", "extra_query", "extra_body", "timeout"}
    params = inspect.signature(method).parameters
    kwargs = {name: None for name, p in params.items()
              if p.default is not inspect.Parameter.empty and name not in options}
    assert len(kwargs) > 10         # the client still has its many optional arguments
    return {**kwargs, **given}


def test_the_official_client_may_pass_none_for_every_optional_argument(client):
    """openai-python sends an argument passed as None as an explicit null: each was a 400
    (temperature, top_p, n, penalties, logprobs, parallel_tool_calls, stream, echo, store,
    truncation, ...)."""
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="key-1", http_client=client, max_retries=0)
    chat = oai.chat.completions.create(**_nones(oai.chat.completions.create, {"model": "llm", "messages": MESSAGES}))
    assert chat.choices[0].message.content == "Hello." and chat.choices[0].finish_reason == "stop"
    done = oai.completions.create(**_nones(oai.completions.create, {"model": "llm", "prompt": "Say hi"}))
    assert done.choices[0].text == "Hello." and len(done.choices) == 1
    reply = oai.responses.create(**_nones(oai.responses.create, {"model": "llm", "input": "hi"}))
    assert reply.output_text == "Hello." and reply.status == "completed"
    assert (reply.temperature, reply.top_p, reply.store, reply.parallel_tool_calls, reply.truncation) == \
        (1.0, 1.0, True, True, "disabled")
    assert oai.responses.retrieve(reply.id).id == reply.id        # store: null is store: true
    chat_sent, completion_sent, _ = client.app.state.llm.sent
    assert chat_sent["n"] == 1 and chat_sent["temperature"] == 1.0 and chat_sent["max_tokens"] is None
    assert completion_sent["max_tokens"] == 16            # null: the default, as OpenAI's


NULL_FIELDS = {
    "/v1/chat/completions": ({"model": "llm", "messages": MESSAGES},
                             ["temperature", "top_p", "n", "presence_penalty", "frequency_penalty", "logprobs",
                              "parallel_tool_calls", "stream", "top_logprobs", "max_tokens",
                              "max_completion_tokens", "stream_options", "top_k", "min_p", "repetition_penalty",
                              "min_tokens", "ignore_eos", "seed", "stop", "tools", "tool_choice"]),
    "/v1/completions": ({"model": "llm", "prompt": "Say hi"},
                        ["echo", "temperature", "top_p", "n", "presence_penalty", "frequency_penalty", "logprobs",
                         "stream", "max_tokens", "best_of", "suffix", "prompt_logprobs", "stream_options"]),
    "/v1/responses": ({"model": "llm", "input": "hi"},
                      ["temperature", "top_p", "store", "parallel_tool_calls", "truncation", "stream",
                       "max_output_tokens", "top_k", "tools", "tool_choice", "text", "instructions"]),
}


@pytest.mark.parametrize("path", sorted(NULL_FIELDS))
def test_explicit_nulls_are_the_defaults(client, path):
    body, fields = NULL_FIELDS[path]
    r = client.post(path, json={**body, **{f: None for f in fields}}, headers=KEY)
    assert r.status_code == 200, r.json()
    assert client.post(path, json=body, headers=KEY).status_code == 200
    # nothing differs from leaving them out
    with_nulls, without = client.app.state.llm.sent
    assert with_nulls == without
    # and the declared schema says so
    doc = client.app.openapi()
    name = {"/v1/chat/completions": "ChatCompletionRequest", "/v1/completions": "CompletionRequest",
            "/v1/responses": "ResponsesRequest"}[path]
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    assert jsonschema.Draft202012Validator(schema).is_valid({**body, **{f: None for f in fields}})


def test_an_assistant_tool_call_may_send_a_null_type(client):
    messages = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": None, "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    r = client.post("/v1/chat/completions", json={"model": "llm", "messages": messages}, headers=KEY)
    assert r.status_code == 200, r.json()


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"model": None, "messages": MESSAGES}, "model"),
    ("/v1/chat/completions", {"model": "llm", "messages": None}, "messages"),
    ("/v1/completions", {"model": "llm", "prompt": None}, "prompt"),
    ("/v1/responses", {"model": "llm", "input": None}, "input"),
    ("/v1/chat/completions", {"model": "llm", "messages": MESSAGES, "temperature": "1"}, "temperature"),  # still strict
])
def test_a_null_required_field_is_a_400_naming_it(client, path, body, param):
    r = client.post(path, json=body, headers=KEY)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()
    if body.get(param, "") is None:
        assert "must not be null" in r.json()["error"]["message"]
    assert client.app.state.llm.sent == []


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": "llm", "prompt": "a", "best_of": 2}, "best_of"),
    ("/v1/completions", {"model": "llm", "prompt": "a", "max_tokens": 2**31}, "max_tokens"),
    ("/v1/completions", {"model": "llm", "prompt": "a", "max_tokens": 2**64}, "max_tokens"),
    ("/v1/chat/completions", {"model": "llm", "messages": MESSAGES, "max_tokens": 2**31}, "max_tokens"),
    ("/v1/chat/completions", {"model": "llm", "messages": MESSAGES, "max_completion_tokens": 2**31},
     "max_completion_tokens"),
    ("/v1/responses", {"model": "llm", "input": "hi", "max_output_tokens": 2**31}, "max_output_tokens"),
    ("/v1/completions", {"model": "llm", "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": "llm", "prompt": ["a", ""]}, "prompt"),
    ("/v1/completions", {"model": "llm", "prompt": [[5], []]}, "prompt"),
])
def test_out_of_range_requests_are_400s_in_our_words(client, path, body, param):
    r = client.post(path, json=body, headers=KEY)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()
    assert r.json()["error"]["message"].startswith(f"invalid '{param}'")
    assert client.app.state.llm.sent == []          # refused before Triton


def test_the_largest_counts_still_pass(client):
    r = client.post("/v1/completions", json={"model": "llm", "prompt": "a", "max_tokens": 2**31 - 1, "best_of": 1},
                    headers=KEY)
    assert r.status_code == 200 and client.app.state.llm.sent[0]["max_tokens"] == 2**31 - 1


@pytest.mark.parametrize("route,field", [("/v1/chat/completions", "messages"), ("/v1/responses", "input"),
                                         ("/tokenize", "messages")])
def test_too_many_messages_are_refused_before_any_is_validated(client, route, field):
    """Issue 49 item 13: a chat of 400k tiny messages (16 MiB) stalled every stream about
    4 s, and costs seconds of CPU to validate and render. Counted first, refused with a
    400 naming the field."""
    import json

    from frontend.openai_api.protocol import MAX_CHAT_MESSAGES
    many = [{"role": "user", "content": "x"}] * 400_000
    body = json.dumps({"model": "llm", field: many}).encode()
    r, elapsed, waits = post_while_probing(client, route, body, KEY)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert f"more than the {MAX_CHAT_MESSAGES}" in r.json()["error"]["message"]
    assert elapsed < 5.0                # was 4+ s of validation and rendering; decoding the 12 MiB remains
    assert waits and max(waits) < 2.0, waits       # (the stall was 4.3 s a request)


def test_the_red_teams_deep_body_is_a_400_and_the_loop_keeps_answering(client):
    """Issue 49 item 2: 130 `[`, a quote, then escaped quotes (128 KB) froze the event loop
    for 55 s (a quadratic regex). Through the app: a 400 about the nesting, while a normal
    request sent meanwhile is answered (2 MiB of it here: linear now)."""
    body = b"[" * 130 + b'"' + b'\\"' * (1 << 20)
    r, elapsed, waits = post_while_probing(client, "/v1/chat/completions", body, KEY)
    assert r.status_code == 400 and "levels deep" in r.text, r.text
    assert elapsed < 5.0 and max(waits) < 2.0, (elapsed, waits)
