"""The robustness bugs of issue 31, against real processes:

- a frontend started before tritonserver answers an OpenAI-shaped 503, then serves within
  about a second of Triton's readiness (gRPC's reconnect backoff had grown to tens of s);
- its first chat requests, ten at once, all succeed (they raced on loading the tokenizer);
- requests the engine refuses at once leave nothing live in Triton: stopping it is quick
  (the frontend cancelled each stream right after its final response, which could
  overtake the request's release and keep the model live for Triton's 30 s exit timeout);
- a non-streaming client that disconnects is one line in the frontend's log, not a
  CancelledError traceback;
- a 16 MB prompt is refused fast, and a small request beside it is not held up (it was
  tokenized whole on the engine thread first: 27-46 s).
"""

import http.client
import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from clients.tritonserver import ROOT, TritonServer, free_port, server_env
from tests.integration.conftest import infer, wait_blocks_free

CHAT = {"model": "llm", "messages": [{"role": "user", "content": "What is a generator?"}], "max_tokens": 4}
# Each refused by the engine itself (after parsing): more than max_model_len=1024 asks for.
REFUSED = [("/v1/completions", {"model": "llm", "prompt": "hello", "max_tokens": 5000}),
           ("/v1/completions", {"model": "llm", "prompt": "hello " * 100, "max_tokens": 1000, "stream": True}),
           ("/v1/chat/completions", {**CHAT, "max_tokens": 2000})]


def post(url: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            text = r.read().decode()
            return r.status, json.loads(text) if not body.get("stream") else {"events": text}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_frontend_before_triton_first_chats_refusals_and_disconnects(model_repo, tmp_path):
    triton = TritonServer(model_repo, log_path=str(tmp_path / "triton.log"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    frontend_log = tmp_path / "frontend.log"
    env = {k: v for k, v in server_env().items() if k not in ("API_KEY", "API_KEY_FILE")}
    env.update(triton.admin.env())
    with open(frontend_log, "w") as out:
        frontend = subprocess.Popen([sys.executable, "-m", "frontend.openai_api", "--port", str(port),
                                     "--triton-url", triton.grpc_url, "--model-repository", model_repo],
                                    cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:                                       # the frontend is up (Triton is not)
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
            except urllib.error.HTTPError as e:
                assert e.code == 503
                break
            except OSError:
                assert time.monotonic() < deadline and frontend.poll() is None, frontend_log.read_text()
                time.sleep(0.2)
        # (b) Triton unreachable: a 503 in OpenAI's error shape, for a listing and a completion
        for path, body in (("/v1/completions", {"model": "llm", "prompt": "x", "max_tokens": 2}), ("/v1/chat/completions", CHAT)):
            status, answer = post(url + path, body)
            assert status == 503 and answer["error"]["code"] == 503 and answer["error"]["type"], answer
        time.sleep(3)                     # the channel's reconnect backoff grows meanwhile (gRPC's default: to 120 s)
        triton.start()
        ready = time.monotonic()
        while post(url + "/v1/completions", {"model": "llm", "prompt": "x", "max_tokens": 2})[0] != 200:
            # (~1 s on an idle machine; the bound leaves room for a loaded CI runner)
            assert time.monotonic() - ready < 5.0, "the frontend did not serve within 5 s of Triton's readiness"
            time.sleep(0.05)
        # (c) the first chat requests, ten at once
        with ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(lambda _: post(url + "/v1/chat/completions", CHAT), range(10)))
        assert [status for status, _ in answers] == [200] * 10, answers
        # (a) refused by the engine at once, streamed and not, many times (the race was
        # lost about once in 30 such requests)
        for _ in range(15):
            for path, body in REFUSED:
                status, answer = post(url + path, body)
                assert status == 400 and "max_model_len" in answer["error"]["message"], answer
        # (f) a non-streaming client that leaves mid-request
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": "llm", "prompt": "x", "max_tokens": 1000,
                                                            "min_tokens": 1000, "ignore_eos": True}),
                     {"content-type": "application/json"})
        time.sleep(1.0)
        conn.close()
        wait_blocks_free(triton, timeout_s=15)
        deadline = time.monotonic() + 10
        while "client disconnected" not in frontend_log.read_text():
            assert time.monotonic() < deadline, frontend_log.read_text()
            time.sleep(0.1)
    finally:
        frontend.terminate()
        frontend.wait(timeout=30)
        triton.stop()
    log = frontend_log.read_text()
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert len(re.findall(r"client disconnected", log)) == 1
    # (a) Triton's exit: the model unloads after its drain (grace_period_s=2), not at the
    # 30 s exit timeout with "Found 1 live models" every second.
    live = re.findall(r"Found [1-9]\d* live models", open(triton.log_path).read())
    assert len(live) < 8, live


def test_a_16_mb_prompt_is_refused_fast_and_holds_up_no_one(server):
    big = "The pass statement does nothing at all. " * (16 * 2**20 // 40)
    params = np.array([json.dumps({"max_tokens": 2}).encode()], dtype=object)
    result: dict = {}

    def send_big():
        start = time.monotonic()
        result["big"] = infer(server, "llm", {"text_input": np.array([big.encode()], dtype=object),
                                              "sampling_parameters": params}, request_id="big")
        result["big_s"] = time.monotonic() - start
    thread = threading.Thread(target=send_big)
    thread.start()
    time.sleep(0.5)                       # the big one is in the backend by now
    start = time.monotonic()
    responses, error = infer(server, "llm", {"text_input": np.array([b"hello"], dtype=object),
                                             "sampling_parameters": params}, request_id="small")
    small_s = time.monotonic() - start
    thread.join(timeout=120)
    assert error is None and responses and small_s < 5.0, (error, small_s)
    _, big_error = result["big"]
    assert "max_model_len is 1024" in big_error and result["big_s"] < 10.0, result
    wait_blocks_free(server)
