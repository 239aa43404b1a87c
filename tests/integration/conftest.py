"""Integration tests start a REAL tritonserver 2.51 (from the nvidia-pytriton wheel, see
clients/tritonserver.py) with the `paged_llm` backend and talk to it over gRPC/HTTP.
Nothing here fakes triton_python_backend_utils."""

import os
import queue
import re
import time
from typing import Optional

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

import pytest

from builder.build import BuildOptions, build
from clients.tritonserver import TritonServer

pytestmark = pytest.mark.integration


def build_repo(repo, checkpoint: str, **options) -> str:
    """The default test repository (model `llm`), with options on top."""
    build(BuildOptions.create(**{**dict(checkpoint=checkpoint, output=str(repo / "llm"), name="llm", link=True,
                                        block_size=16, num_kv_blocks=256, max_num_seqs=16,
                                        max_num_batched_tokens=256, max_model_len=1024, max_queue_size=48,
                                        grace_period_s=2.0), **options}),
          log=lambda *_: None)
    return str(repo)


@pytest.fixture(scope="session", autouse=True)
def genai_perf_venv():
    """genai-perf's own venv installs while the first tests run (its tests come late)."""
    from benchmarks import genai_perf
    genai_perf.prepare_in_background()


@pytest.fixture(scope="session")
def lora_adapters(tmp_path_factory, tiny_ckpt):
    """Two PEFT adapters of the default model (tests/helpers/adapters.py)."""
    from tests.helpers.adapters import make_adapter
    root = tmp_path_factory.mktemp("loras")
    return {"sql": make_adapter(tiny_ckpt, str(root / "sql"), rank=8, alpha=16, seed=1),
            "chat": make_adapter(tiny_ckpt, str(root / "chat"), rank=4, alpha=8, targets=("q_proj", "v_proj"),
                                 seed=2)}


@pytest.fixture(scope="session")
def model_repo(tmp_path_factory, tiny_ckpt, lora_adapters):
    # The session's model serves the base model and two LoRA adapters (copied into the
    # entry by the builder), as a multi-LoRA deployment does.
    # A short compile bound: test_request_limits.py's slow schema then fails (and frees
    # its compile thread) in about a second.
    return build_repo(tmp_path_factory.mktemp("repo"), tiny_ckpt, lora_modules=lora_adapters, max_loras=2,
                      guided_compile_timeout_s=1.0)


# The session's OpenAI frontend takes two keys, as during a key rotation.
API_KEY, NEXT_API_KEY = "sk-test-current-0123456789", "sk-test-next-9876543210"


# The frontend's tool calling and reasoning, as `make serve` sets them for the default
# model (its template writes Hermes-style calls and Qwen3-style thinking).
OPENAI_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]


@pytest.fixture(scope="session")
def session_server(model_repo):
    # Supervised and with the OpenAI frontend, as `make serve` runs it. perf_analyzer and
    # genai-perf read the model config over gRPC and cannot send headers there, so this
    # server opens model-config (test_security.py checks the default on a server of its own).
    # Its HTTP port is the guard's, as `make serve` off loopback has it: every HTTP client
    # of the suite goes through frontend/http_guard.py to tritonserver.
    srv = TritonServer(model_repo, log_path=os.path.join(model_repo, "..", "server.log"), supervised=True,
                       openai=True, api_keys=(API_KEY, NEXT_API_KEY), unrestricted_apis=("model-config",),
                       extra_args=[*OPENAI_FLAGS, "--http-guard", "on"])
    with srv:
        yield srv


@pytest.fixture(scope="session")
def server(session_server):
    """The session's server. A module that parametrizes a `server` of its own depends on
    `session_server` instead: a parametrized override that requested `server` itself would
    hand its parameters to this session fixture, which pytest then tears down and starts
    again at every parameter switch (it did: two restarts of 20-30 s each)."""
    return session_server


def metric(server, name: str, labels: str = 'model="llm"') -> float:
    """The value of the series of `name` whose labels include `labels` (every series of
    ours also carries version="...", as the vLLM backend's do)."""
    want = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", server.metrics(), re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if want.items() <= have.items():
            return float(m.group(2))
    raise AssertionError(f"{name}{{{labels}}} not found in metrics")


def wait_blocks_free(server, timeout_s: float = 10.0, model: str = "llm") -> None:
    """Leak check through the metrics endpoint: every KV block back in the pool."""
    deadline = time.monotonic() + timeout_s
    labels = f'model="{model}"'
    while True:
        try:
            used = metric(server, "llm_kv_cache_blocks_used", labels)
            running = (metric(server, "vllm:num_requests_running", labels)
                       + metric(server, "vllm:num_requests_waiting", labels))
        except OSError as e:            # a read past its 5 s on a busy machine: not yet (seen once in CI)
            used, running = f"unknown ({e})", "unknown"
        if used == 0 and running == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{used} KV blocks still used, {running} requests in the engine")
        time.sleep(0.05)


def wait_metric(server, name: str, expected: float, labels: str = 'model="llm"', timeout_s: float = 5.0) -> float:
    """Metrics reach Triton within ~0.5 s of the event: poll until the value is expected."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = metric(server, name, labels)
        if value == expected or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def assert_served_like_offline(repo: str, log_path: str, prompts: list[str], params: dict, offline) -> None:
    """Starts tritonserver on `repo`, streams each prompt to model 'llm' and checks its
    tokens against the offline engine's outputs; ends with the block pool free."""
    from clients.triton_client import StreamingRequest
    with TritonServer(repo, log_path=log_path) as srv:
        for p, o in zip(prompts, offline):
            res = StreamingRequest(srv.grpc_url).run(p, params)
            assert res.ok and res.token_ids == o.token_ids
        wait_blocks_free(srv)


def auth(extra: Optional[dict] = None) -> dict:
    """Request headers with the session frontend's API key."""
    return {"authorization": f"Bearer {API_KEY}", **(extra or {})}


def openai_frontend(server, timeout_s: float = 60.0) -> str:
    """The OpenAI frontend's URL once it answers /health."""
    import urllib.request
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(server.openai_url + "/health", timeout=2) as r:
                if r.status == 200:
                    return server.openai_url
        except OSError:
            pass
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.2)


def tensor(name, value):
    t = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
    t.set_data_from_numpy(value)
    return t


def infer(server, model: str, inputs: dict[str, np.ndarray], outputs=("text_output",), request_id="r1", cancel_after=None):
    """One request, as given, on its own gRPC stream; returns (responses, error)."""
    done: "queue.Queue" = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: done.put((result, error)))
    client.async_stream_infer(model, [tensor(k, v) for k, v in inputs.items()], request_id=request_id,
                              outputs=[grpcclient.InferRequestedOutput(o) for o in outputs],
                              enable_empty_final_response=True)
    responses, error = [], None
    while True:
        result, err = done.get(timeout=60)
        if err is not None:
            error = str(err)
            break
        response = result.get_response()
        if response.outputs:  # a final response may carry data too (llm's does)
            responses.append(result)
        if response.parameters["triton_final_response"].bool_param:
            break
        if cancel_after is not None and len(responses) >= cancel_after:
            client.stop_stream(cancel_requests=True)
            client.close()
            return responses, "cancelled"
    client.stop_stream()
    client.close()
    return responses, error
