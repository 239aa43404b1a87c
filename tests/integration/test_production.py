"""Production behaviour against a real tritonserver: every bad input gets a clear
per-request error and the server keeps serving; load shedding; metrics that match the
workload; a crashed engine takes the model out of service; graceful shutdown."""

import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from builder.build import BuildOptions, build
from clients.triton_client import StreamingRequest
from clients.tritonserver import TritonServer
from supervisor.processes import stubs_of
from tests.helpers.faults import build_fault_repo, trigger
from tests.integration.conftest import metric, wait_blocks_free, wait_metric

OK_PARAMS = {"max_tokens": 8, "temperature": 0}


def s(x):
    return np.array([x.encode() if isinstance(x, str) else x], dtype=np.object_)


def sp(obj):
    return {"sampling_parameters": s(json.dumps(obj))}


BAD_INPUTS = {
    # name: (prompt, extra tensors, text the error must contain)
    "missing_text_input": (None, {}, "no prompt"),
    "empty_text_input": ("", {}, "no prompt"),
    "prompt_over_max_model_len": ("word " * 1100, {}, "max_model_len"),
    "max_tokens_zero": ("hi", sp({"max_tokens": 0}), "max_tokens"),
    "max_tokens_negative_scalar": ("hi", {"max_tokens": np.array([-3], dtype=np.int32)}, "max_tokens"),
    "max_tokens_too_large": ("hi", sp({"max_tokens": 5000}), "max_tokens"),
    "negative_temperature": ("hi", sp({"temperature": -0.5}), "temperature"),
    "nan_temperature": ("hi", {"temperature": np.array([np.nan], dtype=np.float32)}, "temperature"),
    "nan_temperature_json": ("hi", {"sampling_parameters": s('{"temperature": NaN}')}, "temperature"),
    "top_p_zero": ("hi", sp({"top_p": 0}), "top_p"),
    "top_p_above_one": ("hi", sp({"top_p": "1.5"}), "top_p"),
    "top_k_below_minus_one": ("hi", sp({"top_k": -2}), "top_k"),
    "unknown_key": ("hi", sp({"max_tokens": 4, "best_of": 2}), "unknown sampling parameter 'best_of'"),
    "invalid_json": ("hi", {"sampling_parameters": s("{max_tokens: 4")}, "not valid JSON"),
    "json_not_object": ("hi", {"sampling_parameters": s("[1, 2]")}, "JSON object"),
    "wrong_value_type": ("hi", sp({"max_tokens": "many"}), "max_tokens"),
    "wrong_list_type": ("hi", sp({"stop_token_ids": "nope"}), "stop_token_ids"),
    "token_ids_outside_vocab": (None, {"input_ids": np.array([5, 999999], dtype=np.int32)}, "outside the vocabulary"),
    "invalid_utf8": (None, {"text_input": np.array([b"\xff\xfe bad"], dtype=np.object_)}, "not valid UTF-8"),
    "wrong_dtype": (None, {"text_input": np.array([7], dtype=np.int32)}, "text_input"),
    "wrong_shape": (None, {"text_input": np.array([b"a", b"b"], dtype=np.object_)}, "text_input"),
    "text_and_ids_disagree": ("hello world", {"input_ids": np.array([5, 6, 7], dtype=np.int32)}, "disagree"),
    "beam_search": ("hi", {"beam_width": np.array([4], dtype=np.int32)}, "beam_width"),
    "scalar_conflicts_json": ("hi", {**sp({"max_tokens": 4}), "max_tokens": np.array([9], dtype=np.int32)},
                              "given twice"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_gets_clear_error_then_server_serves(server, case):
    prompt, extra, expected = BAD_INPUTS[case]
    res = StreamingRequest(server.grpc_url).run(prompt, None, extra=extra)
    assert res.error is not None, f"{case} was accepted"
    assert expected in res.error, res.error
    good = StreamingRequest(server.grpc_url).run("The pass statement", OK_PARAMS)
    assert good.ok and len(good.token_ids) >= 1
    wait_blocks_free(server)


def test_stream_with_input_echo_is_refused_as_vllm_does(server):
    res = StreamingRequest(server.grpc_url).run(
        "The pass statement", OK_PARAMS, stream=True, extra={"exclude_input_in_output": np.array([False])})
    assert res.error and "When streaming, `exclude_input_in_output` = False is not allowed." in res.error
    wait_blocks_free(server)


def test_overload_sheds_with_unavailable(server):
    """max_queue_size=48, max_num_seqs=16: 120 simultaneous requests overflow the queue."""
    rejected_before = metric(server, "llm_requests_rejected_total", 'model="llm",reason="queue_full"')
    params = {"max_tokens": 24, "min_tokens": 24, "temperature": 0}
    with ThreadPoolExecutor(120) as pool:
        results = list(pool.map(lambda i: StreamingRequest(server.grpc_url).run(f"Request {i}", params), range(120)))
    shed = [r for r in results if r.error]
    done = [r for r in results if r.ok]
    assert shed, "nothing was shed"
    assert all("UNAVAILABLE" in r.error and "max_queue_size=48" in r.error for r in shed), shed[0].error
    assert all(len(r.token_ids) == 24 for r in done)
    assert len(shed) + len(done) == 120
    wait_blocks_free(server)
    expected = rejected_before + len(shed)
    assert wait_metric(server, "llm_requests_rejected_total", expected, 'model="llm",reason="queue_full"') == expected


def test_metrics_match_a_known_workload(server, tiny_ckpt):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    wait_blocks_free(server)
    names = ["vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:e2e_request_latency_seconds_count",
             "vllm:time_to_first_token_seconds_count"]
    before = {n: metric(server, n) for n in names}
    invalid_before = metric(server, "llm_requests_rejected_total", 'model="llm",reason="invalid_request"')
    prompts = [f"The {w} statement is here" for w in ("if", "for", "while", "try", "with")]
    for i, p in enumerate(prompts):
        res = StreamingRequest(server.grpc_url).run(p, {"max_tokens": 5 + i, "min_tokens": 5 + i, "temperature": 0})
        assert res.ok
    StreamingRequest(server.grpc_url).run("x", {"top_p": 7})
    expected = {
        "vllm:prompt_tokens_total": before["vllm:prompt_tokens_total"] + sum(len(tok.encode(p)) for p in prompts),
        "vllm:generation_tokens_total": before["vllm:generation_tokens_total"] + sum(range(5, 10)),
        "vllm:e2e_request_latency_seconds_count": before["vllm:e2e_request_latency_seconds_count"] + 5,
        "vllm:time_to_first_token_seconds_count": before["vllm:time_to_first_token_seconds_count"] + 5,
    }
    for name, value in expected.items():
        assert wait_metric(server, name, value) == value, name
    assert wait_metric(server, "llm_requests_rejected_total", invalid_before + 1,
                       'model="llm",reason="invalid_request"') == invalid_before + 1
    assert metric(server, "llm_kv_cache_blocks_total") == 256


def _own_server(tmp_path, tiny_ckpt, **opts):
    tmp_path.mkdir(parents=True, exist_ok=True)
    repo = tmp_path / "repo"
    base = dict(checkpoint=tiny_ckpt, output=str(repo / "llm"), name="llm", link=True, block_size=16,
                num_kv_blocks=128, max_model_len=1024)
    build(BuildOptions.create(**{**base, **{k: v for k, v in opts.items() if k != "params"}}), log=lambda *_: None)
    extra = opts.get("params") or {}
    if extra:
        with open(repo / "llm" / "config.pbtxt", "a") as f:
            for k, v in extra.items():
                f.write(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n')
    return TritonServer(str(repo), log_path=str(tmp_path / "server.log"))


def test_crashed_engine_fails_requests_and_model_turns_not_ready(tmp_path, tiny_ckpt):
    """Without the supervisor (plain tritonserver): the model takes itself out of service."""
    repo = build_fault_repo(str(tmp_path), tiny_ckpt)
    with TritonServer(repo, log_path=str(tmp_path / "server.log")) as srv:
        assert srv.model_ready("llm")
        trigger(repo, "crash")
        res = StreamingRequest(srv.grpc_url).run("hello", {"max_tokens": 50, "temperature": 0}, timeout_s=30)
        assert res.error and "engine" in res.error and "injected fault" in res.error
        deadline = time.monotonic() + 30
        while srv.model_ready("llm") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not srv.model_ready("llm")
        after = StreamingRequest(srv.grpc_url).run("hello", OK_PARAMS, timeout_s=30)
        assert after.error


STUB_CRASHED = "stub crashed"
ATTEMPTS = 8        # (all 5 of one CI run's attempts hit the crash, in a slow spell: 2026-11-30)


def _shutdown_attempt(tmp_path, tiny_ckpt):
    """SIGTERM while a stream is sending. Returns (exit code, seconds to exit, results,
    server log), or STUB_CRASHED when the backend never reacted: the known upstream crash
    (docs/reliability.md), recognised within 5 s so that a retry is cheap."""
    srv = _own_server(tmp_path, tiny_ckpt, grace_period_s=1.0)
    srv.extra_args = ["--exit-timeout-secs", "8"]
    srv.start()
    results = {}
    log_path = tmp_path / "server.log"
    streaming = threading.Event()

    def run(name, params, on_piece=None):
        results[name] = StreamingRequest(srv.grpc_url).run("The pass statement", params, timeout_s=60,
                                                           on_piece=on_piece)

    short = threading.Thread(target=run, args=("short", {"max_tokens": 3, "temperature": 0}), daemon=True)
    endless = threading.Thread(target=run, args=("endless", {"max_tokens": 1000, "ignore_eos": True,
                                                             "temperature": 0}, lambda _: streaming.set()),
                               daemon=True)
    code, elapsed = None, float("inf")
    try:
        endless.start()
        assert streaming.wait(30), "the stream never started"
        # This server's backend regions (other servers may run beside it: make test's workers).
        own = [stub for stub in stubs_of() if stub.model_path.startswith(str(tmp_path))]
        own_regions = {stub.shm_region for stub in own}
        # The backend asks the server's HTTP port whether it is stopping (readiness.py):
        # without that address it falls back to the IPC call that crashes the stub.
        for stub in own:
            with open(f"/proc/{stub.pid}/environ", "rb") as f:
                assert b"PAGED_LLM_SERVER_HTTP=127.0.0.1:" in f.read()
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        short.start()
        # A live backend notices the stop within about a second (its readiness probe).
        # The crash can also take the server down at once, before our code logs anything
        # (seen in CI: Triton's python backend library signalled in the server process):
        # an exit without 'stopping' is that crash too, not a reason to wait forever.
        while "[paged_llm] stopping" not in log_path.read_text():
            exited = srv.proc.poll() is not None
            if exited or time.monotonic() - t0 > 5:
                if not exited:
                    srv.proc.kill()  # it would only wait out its exit timeout, and more
                srv.proc.wait()
                # Nobody is left to unlink this server's python-backend regions.
                for name in own_regions & set(os.listdir("/dev/shm")):
                    os.unlink(os.path.join("/dev/shm", name))
                return STUB_CRASHED
            time.sleep(0.1)
        try:
            code = srv.proc.wait(timeout=30)  # the server must exit on its own, in time
            elapsed = time.monotonic() - t0
        except subprocess.TimeoutExpired:
            pass
    finally:
        srv.stop()  # kills a server that did not exit, which also frees blocked clients
    short.join(timeout=30)
    endless.join(timeout=30)
    return code, elapsed, results, log_path.read_text()


def test_graceful_shutdown(tmp_path, tiny_ckpt):
    """SIGTERM while a stream is sending: the stream is ended with an error after the
    grace period, requests after the stop began are refused or served, the model unloads
    and the server exits 0 in time.

    The python backend's stub used to segfault right at SIGTERM in about half of the
    attempts, inside Triton's code for `pb_utils.is_model_ready` (docs/reliability.md);
    the watcher now asks over the server's HTTP port (readiness.py), and this server is
    told that port. An attempt in which the backend never reacts (no 'stopping' line) is
    still recognised and retried with a fresh server, up to ATTEMPTS times; a broken
    drain fails every attempt."""
    crashed = 0
    for attempt in range(ATTEMPTS):
        outcome = _shutdown_attempt(tmp_path / f"a{attempt}", tiny_ckpt)
        if outcome == STUB_CRASHED:
            crashed += 1
            continue
        code, elapsed, results, log = outcome
        break
    else:
        pytest.fail(f"the backend's stub crashed at SIGTERM in all {crashed} attempts")
    print(f"graceful shutdown: {crashed} attempt(s) lost to the stub crash before a clean one")
    assert code == 0 and elapsed < 8, (code, elapsed)
    # The in-flight stream was cut after the grace period with an error, not left hanging.
    assert results["endless"].error and len(results["endless"].token_ids) < 1000
    # New requests after the stop began were refused or completed, never hung.
    assert results["short"].error or results["short"].ok
    assert "[paged_llm] stopping" in log and "[paged_llm] drained" in log
    assert "successfully unloaded 'llm'" in log
