"""Serving through a real tritonserver: concurrency, exactness vs the offline API,
streaming and non-streaming, HTTP, cancellation, errors. Each test ends with the block
pool fully free (checked on the metrics endpoint).

Every test runs three times: against the session's server (one rank), against a server
of its own whose model is split over two ranks (tensor_parallel_size=2, gloo on CPU),
and against one whose layers are split into two pipeline stages (pipeline_parallel_size=2,
two micro-batches in flight), with the same expectations: the single-rank offline
engine's tokens."""

import os

import json
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from backend import LLM, SamplingParams
from clients.triton_client import StreamingRequest
from clients.tritonserver import TritonServer
from tests.integration.conftest import build_repo, metric, wait_blocks_free, wait_metric

PROMPTS = [f"The {w} statement" for w in ("assert", "pass", "del", "return", "yield", "raise", "break",
                                            "continue", "import", "global", "nonlocal", "if", "while",
                                            "for", "try", "with")]
GREEDY = {"max_tokens": 20, "min_tokens": 20, "temperature": 0}


@pytest.fixture(scope="module", params=[None, "tensor_parallel_size", "pipeline_parallel_size"],
                ids=["tp1", "tp2", "pp2"])
def server(request, session_server, tmp_path_factory, tiny_ckpt):
    if request.param is None:
        yield session_server
        return
    repo = build_repo(tmp_path_factory.mktemp("repo_" + request.param), tiny_ckpt, **{request.param: 2})
    # A log of its own: the session server's (conftest.py) is <basetemp>/server.log.
    with TritonServer(repo, log_path=os.path.join(repo, "..", f"server_{request.param}.log"),
                      supervised=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(tiny_ckpt):
    llm = LLM(tiny_ckpt, block_size=16, num_kv_blocks=256)
    outs = llm.generate(PROMPTS, SamplingParams(**GREEDY))
    return {p: o for p, o in zip(PROMPTS, outs)}


def test_16_concurrent_streams_match_offline(server, offline):
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: StreamingRequest(server.grpc_url).run(p, GREEDY), PROMPTS))
    for prompt, res in zip(PROMPTS, results):
        assert res.ok, res.error
        assert res.token_ids == offline[prompt].token_ids
        assert res.text == offline[prompt].text
        assert res.finish_reason == "length"
        assert len(res.times) == 20  # one response per token
    wait_blocks_free(server)


def test_non_streaming_gives_exactly_one_response(server, offline):
    res = StreamingRequest(server.grpc_url).run(PROMPTS[0], GREEDY, stream=False)
    assert res.ok and len(res.pieces) == 1
    # Without exclude_input_in_output a single response echoes the prompt (vLLM backend).
    assert res.text == PROMPTS[0] + offline[PROMPTS[0]].text and res.num_output_tokens == 20
    res = StreamingRequest(server.grpc_url).run(PROMPTS[0], GREEDY, stream=False,
                                                extra={"exclude_input_in_output": np.array([True])})
    assert res.text == offline[PROMPTS[0]].text
    wait_blocks_free(server)


def test_http_generate_and_generate_stream(server, offline):
    body = json.dumps({"text_input": PROMPTS[1], "max_tokens": 20, "min_tokens": 20, "temperature": 0}).encode()
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/llm/generate", body, timeout=60) as r:
        # One response, no exclude_input_in_output: the prompt is echoed (vLLM backend).
        assert json.loads(r.read())["text_output"] == PROMPTS[1] + offline[PROMPTS[1]].text
    body = json.dumps({"text_input": PROMPTS[1], "stream": True,
                       "sampling_parameters": json.dumps({k: str(v) for k, v in GREEDY.items()})}).encode()
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/llm/generate_stream", body, timeout=60) as r:
        events = [json.loads(line[len(b"data: "):]) for line in r.read().splitlines() if line.startswith(b"data: ")]
    assert len(events) == 20
    assert "".join(e["text_output"] for e in events) == offline[PROMPTS[1]].text
    wait_blocks_free(server)


def test_cancelled_stream_frees_blocks_while_others_continue(server, offline):
    long = {"max_tokens": 400, "min_tokens": 400, "temperature": 0}
    cancelled_before = metric(server, "llm_requests_rejected_total", 'model="llm",reason="cancelled"')
    results = {}

    def run_other(i):
        results[i] = StreamingRequest(server.grpc_url).run(PROMPTS[i], GREEDY)

    others = [threading.Thread(target=run_other, args=(i,)) for i in range(2, 6)]
    for t in others:
        t.start()
    res = StreamingRequest(server.grpc_url).run(PROMPTS[0], long, cancel_after=5)
    assert res.cancelled and len(res.times) == 5
    for t in others:
        t.join()
    for i in range(2, 6):
        assert results[i].ok and results[i].token_ids == offline[PROMPTS[i]].token_ids
    wait_blocks_free(server)
    assert wait_metric(server, "llm_requests_rejected_total", cancelled_before + 1,
                       'model="llm",reason="cancelled"') == cancelled_before + 1


def test_malformed_sampling_parameters_then_success(server, offline):
    bad = StreamingRequest(server.grpc_url)
    res = bad.run(PROMPTS[0], extra={"sampling_parameters": np.array([b"{not json"], dtype=np.object_)})
    assert res.error and "sampling_parameters" in res.error and "not valid JSON" in res.error
    res = StreamingRequest(server.grpc_url).run(PROMPTS[0], GREEDY)
    assert res.ok and res.token_ids == offline[PROMPTS[0]].token_ids
    wait_blocks_free(server)


def test_input_ids_and_exclude_input(server, tiny_ckpt, offline):
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(tiny_ckpt).encode(PROMPTS[3])
    res = StreamingRequest(server.grpc_url).run(None, GREEDY, input_ids=ids)
    assert res.ok and res.token_ids == offline[PROMPTS[3]].token_ids
    res = StreamingRequest(server.grpc_url).run(
        PROMPTS[3], GREEDY, stream=False, extra={"exclude_input_in_output": np.array([False])})
    assert res.text == PROMPTS[3] + offline[PROMPTS[3]].text
    wait_blocks_free(server)


def test_trtllm_scalar_inputs(server, offline):
    extra = {"max_tokens": np.array([20], dtype=np.int32), "min_length": np.array([20], dtype=np.int32),
             "temperature": np.array([0.0], dtype=np.float32)}
    res = StreamingRequest(server.grpc_url).run(PROMPTS[4], None, extra=extra)
    assert res.ok and res.token_ids == offline[PROMPTS[4]].token_ids
    wait_blocks_free(server)
