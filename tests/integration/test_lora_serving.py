"""Multi-LoRA through the session's real tritonserver (supervised, with the OpenAI
frontend, as `make serve`): its `llm` entry serves the base model and the adapters `sql`
and `chat` (built with `builder build --lora`). tritonclient streams with `lora_name` in
`sampling_parameters` (the vLLM backend's contract), and the official `openai` client
names an adapter as the model. Every answer equals the offline engine's under the same
adapter (which equals transformers + PEFT: tests/unit/lora/)."""

import json
import re
import threading
import time
import urllib.error
import urllib.request

import pytest

from backend import LLM, SamplingParams
from clients.triton_client import StreamingRequest
from tests.integration.conftest import API_KEY, openai_frontend, wait_blocks_free

PROMPT = "The with statement"
PARAMS = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def offline(tiny_ckpt, lora_adapters):
    llm = LLM(tiny_ckpt, block_size=16, num_kv_blocks=128, lora_modules=lora_adapters, max_loras=2)
    return {name: llm.generate([PROMPT], SamplingParams(**PARAMS, lora_name=name))[0]
            for name in (None, "sql", "chat")}


def test_adapters_and_base_share_the_server(server, offline):
    """Three concurrent streams, one per adapter and one on the base model."""
    assert len({tuple(o.token_ids) for o in offline.values()}) == 3
    results = {}

    def run(name):
        params = {**PARAMS, **({"lora_name": name} if name else {})}
        results[name] = StreamingRequest(server.grpc_url).run(PROMPT, params)
    threads = [threading.Thread(target=run, args=(n,)) for n in offline]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for name, want in offline.items():
        assert results[name].ok, results[name].error
        assert results[name].token_ids == want.token_ids, name
    wait_blocks_free(server)


def test_unknown_adapter_is_a_clear_error(server, offline):
    res = StreamingRequest(server.grpc_url).run(PROMPT, {**PARAMS, "lora_name": "nope"})
    assert not res.ok
    assert "LoRA nope is not supported, we currently support ['sql', 'chat']" in res.error
    ok = StreamingRequest(server.grpc_url).run(PROMPT, {**PARAMS, "lora_name": "chat"})
    assert ok.ok and ok.token_ids == offline["chat"].token_ids
    wait_blocks_free(server)


def test_openai_client_names_the_adapter_as_model(server, offline):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=openai_frontend(server) + "/v1", api_key=API_KEY, max_retries=0)
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {"llm", "sql", "chat"}
    assert listed["sql"].model_extra["parent"] == "llm" and listed["llm"].model_extra["parent"] is None
    for name in ("sql", "chat", "llm"):
        r = client.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        want = offline[None if name == "llm" else name]
        assert r.choices[0].text == want.text, name
        assert r.usage.completion_tokens == 12 and r.model == name
    wait_blocks_free(server)


def lora_info_series(server) -> list[dict[str, str]]:
    return [dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            for m in re.finditer(r'^vllm:lora_requests_info\{([^}]*)\} \S+$', server.metrics(), re.M)]


def wait_lora_info(server, running: str, timeout_s: float = 10.0) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        series = lora_info_series(server)
        if len(series) == 1 and series[0]["running_lora_adapters"] == running:
            return series[0]
        assert time.monotonic() < deadline, series
        time.sleep(0.05)


def test_lora_requests_info_names_the_running_adapters(server, offline):
    """vLLM's `vllm:lora_requests_info`: while a request under `sql` runs, the gauge's one
    series names it; once the request ends, the one series names no adapter."""
    seen = threading.Event()
    result = {}

    def run():
        # The stream's first piece waits until the metric was read; then it is cancelled.
        result["r"] = StreamingRequest(server.grpc_url).run(
            PROMPT, {**PARAMS, "max_tokens": 1000, "min_tokens": 1000, "lora_name": "sql"},
            on_piece=lambda _: seen.wait(30), cancel_after=1)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        series = wait_lora_info(server, "sql")
        assert series["max_lora"] == "2" and series["waiting_lora_adapters"] == "" and series["model"] == "llm"
    finally:
        seen.set()
        t.join(30)
    assert result["r"].cancelled
    wait_lora_info(server, "")
    wait_blocks_free(server)


@pytest.fixture(scope="module")
def runtime_adapter(tiny_ckpt, lora_adapters, tmp_path_factory):
    """A third adapter, not in the model's config: loaded at run time. Its reference is
    the offline engine's with it listed at load (which equals PEFT's: tests/unit/lora/)."""
    from tests.helpers.adapters import make_adapter
    path = make_adapter(tiny_ckpt, str(tmp_path_factory.mktemp("runtime") / "rt"), rank=8, alpha=16, seed=5)
    llm = LLM(tiny_ckpt, block_size=16, num_kv_blocks=128, lora_modules={"rt": path}, max_loras=1)
    return path, llm.generate([PROMPT], SamplingParams(**PARAMS, lora_name="rt"))[0]


class Reply:
    def __init__(self, status_code: int, text: str) -> None:
        self.status_code, self.text = status_code, text

    def json(self) -> dict:
        return json.loads(self.text)


def lora_post(route: str, body: dict, key: str = API_KEY, server=None) -> Reply:
    headers = {"content-type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(openai_frontend(server) + route, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return Reply(r.status, r.read().decode())
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.read().decode())


def test_adapter_loaded_and_unloaded_while_others_stream(server, offline, runtime_adapter, tmp_path):
    """vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` while base-model and
    `sql` streams run: the loaded adapter answers as the offline engine does; an unload
    waits for the adapter's running request, which ends whole, while new requests for it
    are refused; bad adapters and callers without a key get clear errors; nothing leaks."""
    openai = pytest.importorskip("openai")
    path, want = runtime_adapter
    client = openai.OpenAI(base_url=openai_frontend(server) + "/v1", api_key=API_KEY, max_retries=0)
    results = {}

    def stream(name, params):
        results[name] = StreamingRequest(server.grpc_url).run(PROMPT, params)
    long = {**PARAMS, "max_tokens": 300}
    others = [threading.Thread(target=stream, args=(n, {**long, **({"lora_name": n} if n else {})}))
              for n in (None, "sql")]
    for t in others:
        t.start()
    try:
        refused = lora_post("/v1/load_lora_adapter", {"lora_name": "rt", "lora_path": path}, key=None, server=server)
        assert refused.status_code == 401
        r = lora_post("/v1/load_lora_adapter", {"lora_name": "rt", "lora_path": path}, server=server)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'rt' added successfully.", r.text
        again = lora_post("/v1/load_lora_adapter", {"lora_name": "rt", "lora_path": path}, server=server)
        assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
        missing = lora_post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "none")},
                            server=server)
        assert missing.status_code == 400 and "no adapter_config.json" in missing.json()["error"]["message"]
        assert {m.id for m in client.models.list().data} == {"llm", "sql", "chat", "rt"}
        out = client.completions.create(model="rt", prompt=PROMPT, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == want.text

        # Unload while a request under it streams.
        started = threading.Event()
        t = threading.Thread(target=lambda: results.__setitem__("rt", StreamingRequest(server.grpc_url).run(
            PROMPT, {**long, "max_tokens": 1000, "lora_name": "rt"}, on_piece=lambda _: started.set())))
        t.start()
        assert started.wait(60), results.get("rt")
        r = lora_post("/v1/unload_lora_adapter", {"lora_name": "rt"}, server=server)
        assert r.status_code == 200, r.text
        assert r.text == ("Success: LoRA adapter 'rt' removed successfully. It is dropped once its running requests "
                          "finish."), r.text
        late = StreamingRequest(server.grpc_url).run(PROMPT, {**PARAMS, "lora_name": "rt"})
        assert not late.ok and "LoRA rt is being unloaded" in late.error, late.error
        t.join(120)
    finally:
        for t in others:
            t.join(120)
    assert results["rt"].ok and results["rt"].token_ids[:12] == want.token_ids, results["rt"].error
    assert results[None].ok and results[None].token_ids[:12] == offline[None].token_ids
    assert results["sql"].ok and results["sql"].token_ids[:12] == offline["sql"].token_ids
    gone = lora_post("/v1/unload_lora_adapter", {"lora_name": "rt"}, server=server)
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]
    assert {m.id for m in client.models.list().data} == {"llm", "sql", "chat"}
    wait_blocks_free(server)


def test_triton_side_lora_control_needs_the_admin_key(server, runtime_adapter):
    """The same change through Triton itself (engine_control.py): a request parameter
    `lora_action`; `load` without the server's admin key is refused, `list` is open."""
    path, want = runtime_adapter
    no_key = StreamingRequest(server.grpc_url).run("", parameters={"lora_action": "load", "lora_name": "rt",
                                                                    "lora_path": path, "admin_key": "guess-" * 4})
    assert not no_key.ok and "UNAUTHENTICATED" in no_key.error
    listed = StreamingRequest(server.grpc_url).run("", parameters={"lora_action": "list"})
    assert listed.ok and json.loads(listed.pieces[0]) == {"loaded": ["sql", "chat"], "unloading": []}
    key = server.admin.key
    for action, status in (("load", "loaded"), ("unload", "unloaded")):
        r = StreamingRequest(server.grpc_url).run("", parameters={"lora_action": action, "lora_name": "rt",
                                                                  "lora_path": path, "admin_key": key})
        assert r.ok and json.loads(r.pieces[0]) == {"lora_name": "rt", "status": status}, r.error
