"""Multi-LoRA through the session's real tritonserver (supervised, with the OpenAI
frontend, as `make serve`): its `llm` entry serves the base model and the adapters `sql`
and `chat` (built with `builder build --lora`). tritonclient streams with `lora_name` in
`sampling_parameters` (the vLLM backend's contract), and the official `openai` client
names an adapter as the model. Every answer equals the offline engine's under the same
adapter (which equals transformers + PEFT: tests/unit/lora/)."""

import re
import threading
import time

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
