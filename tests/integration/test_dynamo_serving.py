"""NVIDIA Dynamo in front of our engine. Starts real processes on loopback: NATS and
etcd (Debian's packages), two of our Dynamo workers (`python -m backend.dynamo_worker`)
over one model repository entry of the trained reference model, Dynamo's own frontend
twice over them (`python -m dynamo.frontend`, `--router-mode kv` and `round-robin`), and
our HTTP guard with an API key in front of the KV-routed one. The official `openai`
client talks to them. No tritonserver: Dynamo is the other front door to the same engine.
"""

from __future__ import annotations

import random
import re
import urllib.error
import urllib.request

import pytest

from clients.dynamo_local import Stack, deploy, start_guard, start_services
from tests.helpers.dynamo_services import exit_report, greedy, metric_sum, offline, require_services  # noqa: F401
from tests.helpers.adapters import make_adapter
from tests.integration.conftest import build_repo

pytestmark = pytest.mark.timeout(600)

API_KEY = "dynamo-test-key-0123456789"
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
         "tau upsilon phi chi psi omega").split()


class Deployment:
    def __init__(self, stack: Stack, workers, kv, round_robin, guard, adapter) -> None:
        self.stack, self.workers, self.kv, self.round_robin, self.guard = stack, workers, kv, round_robin, guard
        self.adapter = adapter

    def client(self, port: int, api_key: str = "none"):
        import openai
        return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, trained_ckpt):
    require_services()
    root = tmp_path_factory.mktemp("dynamo")
    adapter = make_adapter(trained_ckpt, str(root / "sql"), rank=8, alpha=16, seed=1)
    repo = build_repo(root / "repo", trained_ckpt, num_kv_blocks=192, max_model_len=1024, lora_modules={"sql": adapter},
                      max_loras=1)
    stack = start_services(str(root))
    try:
        workers, frontends = deploy(stack, repo, 2, {"kv": None, "round-robin": None})
        guard = start_guard(stack, frontends["kv"].port, [API_KEY])
        yield Deployment(stack, workers, frontends["kv"], frontends["round-robin"], guard, adapter)
    finally:
        stack.stop_all()
    # Every worker ended with its block pool free.
    for worker in workers:
        assert exit_report(worker.log())["used"] == 0, worker.log()[-3000:]


def test_the_official_client_is_answered_through_the_kv_router_behind_the_key(deployment, offline):
    import openai
    with pytest.raises(openai.AuthenticationError):
        deployment.client(deployment.guard.port).models.list()
    client = deployment.client(deployment.guard.port, API_KEY)
    assert sorted(m.id for m in client.models.list().data) == ["llm", "sql"]
    # Dynamo's own routes beside the API (an unkeyed /busy_threshold among them) stay behind the guard.
    request = urllib.request.Request(f"http://127.0.0.1:{deployment.guard.port}/busy_threshold", data=b"{}",
                                     method="POST", headers={"Authorization": f"Bearer {API_KEY}"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 404
    messages = [{"role": "user", "content": "Say something"}]
    chat = client.chat.completions.create(model="llm", messages=messages, max_tokens=12, temperature=0)
    # Dynamo applies the checkpoint's chat template; our engine, given the same text, agrees
    # (the reference model was trained on plain text: it ends a chat turn at once).
    want = greedy(offline, offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                 tokenize=False), 12)
    assert (chat.choices[0].message.content or "") == want.text
    assert chat.usage.completion_tokens == len(want.token_ids)
    assert chat.usage.prompt_tokens == len(want.prompt_token_ids)
    stream = client.completions.create(model="llm", prompt="The with statement", max_tokens=8, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices)


def test_greedy_text_equals_the_engine_run_offline(deployment, offline):
    client = deployment.client(deployment.kv.port)
    for prompt in ["The with statement", "def main():", "Once upon a time", "import os\nimport sys\n"]:
        got = client.completions.create(model="llm", prompt=prompt, max_tokens=24, temperature=0)
        want = greedy(offline, prompt, 24)
        assert got.choices[0].text == want.text, prompt
        assert got.usage.completion_tokens == len(want.token_ids), prompt


def test_a_lora_adapter_is_a_model_of_its_own_with_the_engines_tokens(deployment, trained_ckpt):
    """Dynamo lists each adapter of the entry as a model; a request for it runs under the
    adapter, token for token as our engine does offline."""
    from backend.llm import LLM
    from backend.sampling_params import SamplingParams
    client = deployment.client(deployment.kv.port)
    prompt = "The with statement"
    got = [client.completions.create(model=m, prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text for m in ("sql", "llm")]
    with LLM(trained_ckpt, num_kv_blocks=32, max_model_len=256, enable_lora=True, max_loras=1,
             lora_modules={"sql": deployment.adapter}) as llm:
        want = [llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                      lora_name=name))[0].text for name in ("sql", None)]
    assert got == want and got[0] != got[1]


def _conversations(client, seed: int, num_conversations: int = 5, turns: int = 4) -> float:
    """A multi-turn workload: each turn sends the whole history again. Returns the share of
    later turns' prompt tokens served from a worker's prefix cache (the usage's cached_tokens)."""
    rng = random.Random(seed)
    history = [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(num_conversations)]
    prompt_tokens = cached_tokens = 0
    for turn in range(turns):
        for i in range(num_conversations):       # (an odd count: round robin moves each to the other replica)
            history[i] += "\nuser: " + " ".join(rng.choice(WORDS) for _ in range(20)) + "\nassistant:"
            reply = client.completions.create(model="llm", prompt=history[i], max_tokens=8, temperature=0)
            history[i] += reply.choices[0].text
            if turn:
                prompt_tokens += reply.usage.prompt_tokens
                cached_tokens += reply.usage.prompt_tokens_details.cached_tokens
    return cached_tokens / prompt_tokens


def test_the_kv_router_sends_each_conversation_back_to_the_replica_holding_its_prefix(deployment):
    kv_hit_rate = _conversations(deployment.client(deployment.kv.port), seed=1)
    round_robin_hit_rate = _conversations(deployment.client(deployment.round_robin.port), seed=2)
    assert kv_hit_rate >= 0.6, (kv_hit_rate, round_robin_hit_rate)
    assert kv_hit_rate >= round_robin_hit_rate + 0.2, (kv_hit_rate, round_robin_hit_rate)
    # The router built its view from our workers' KV events (relayed over NATS).
    with urllib.request.urlopen(f"http://127.0.0.1:{deployment.kv.port}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert metric_sum(metrics, "dynamo_component_kv_cache_events_applied", event_type="stored", status="ok") > 0


def test_a_stream_its_client_closes_is_cancelled_on_the_worker(deployment):
    client = deployment.client(deployment.kv.port)
    stream = client.completions.create(model="llm", prompt="The with statement", max_tokens=900, temperature=0.8,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    aborted = r"aborted dyn-\w+ after (\d+) tokens: its client went away"
    deployment.stack.wait_for(lambda: any(re.search(aborted, w.log()) for w in deployment.workers),
                              "the worker aborts the closed stream", 60)
    tokens = [int(n) for w in deployment.workers for n in re.findall(aborted, w.log())]
    assert tokens and max(tokens) < 900
    # The worker's pool is checked free when the module's deployment stops (above); here,
    # a normal request still completes right after.
    assert client.completions.create(model="llm", prompt="Once upon a time", max_tokens=4,
                                     temperature=0).choices[0].text is not None
