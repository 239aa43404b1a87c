"""vLLM's sleep mode through the session's real tritonserver (supervised, with the OpenAI
frontend, as `make serve`): `/sleep` needs Triton's admin key; asleep, completions get
a retryable 503; after `/wake_up` greedy tokens are the same as before, at level 1 and
level 2 (weights read again). Also through Triton itself (`sleep_action`)."""

import json
import urllib.error
import urllib.request

import pytest

from clients.triton_client import StreamingRequest
from tests.integration.conftest import API_KEY, openai_frontend, wait_blocks_free

PROMPT = "The with statement"


def call(server, method: str, route: str, key=None) -> tuple[int, str]:
    headers = {"admin-key": key} if key else {}
    request = urllib.request.Request(openai_frontend(server) + route, method=method, headers=headers,
                                     data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def complete(client) -> str:
    return client.completions.create(model="llm", prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_up_give_the_same_tokens(server, level):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=openai_frontend(server) + "/v1", api_key=API_KEY, max_retries=0)
    want = complete(client)
    key = server.admin.key
    assert call(server, "POST", f"/sleep?level={level}")[0] == 401
    assert call(server, "POST", f"/sleep?level={level}", key="not-the-key-000000")[0] == 401
    assert call(server, "GET", "/is_sleeping", key=key) == (200, json.dumps({"is_sleeping": False},
                                                                            separators=(",", ":")))
    try:
        assert call(server, "POST", f"/sleep?level={level}", key=key)[0] == 200
        assert json.loads(call(server, "GET", "/is_sleeping", key=key)[1]) == {"is_sleeping": True}
        with pytest.raises(openai.APIStatusError) as refused:
            complete(client)
        assert refused.value.status_code == 503 and "asleep" in str(refused.value)
    finally:
        assert call(server, "POST", "/wake_up", key=key)[0] == 200
    assert json.loads(call(server, "GET", "/is_sleeping", key=key)[1]) == {"is_sleeping": False}
    assert complete(client) == want
    wait_blocks_free(server)


def test_through_triton_sleep_needs_the_admin_key(server):
    refused = StreamingRequest(server.grpc_url).run("", parameters={"sleep_action": "sleep"})
    assert not refused.ok and "UNAUTHENTICATED" in refused.error
    state = StreamingRequest(server.grpc_url).run("", parameters={"sleep_action": "is_sleeping"})
    assert state.ok and json.loads(state.pieces[0]) == {"is_sleeping": False, "level": 0}
