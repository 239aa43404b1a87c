"""Against the session's server (tests/integration/conftest.py `server`): a REAL
tritonserver 24.10 under the supervisor, with the OpenAI frontend and `--http-guard on`,
started as `make serve` starts it off loopback. Its HTTP port is frontend/http_guard.py's,
tritonserver's own HTTP server on a loopback port behind it.

The red team's crash payloads for Triton 24.10's HTTP server (CVE-2025-23310/23311) go
through the guard: the server survives them, answers a request sent meanwhile, and keeps
serving. The supervisor restarts a killed OpenAI frontend and says so in `/ready`. And
why the guard is there: a bare tritonserver 24.10 of its own (no model, no guard) dies on
the `[` body."""

import http.client
import json
import os
import signal
import socket
import threading
import time
import urllib.request

from tests.integration.conftest import openai_frontend, wait_blocks_free

GENERATE = {"text_input": "The pass statement", "max_tokens": 4, "temperature": 0}


def generate(server, timeout_s=60):
    body = json.dumps(GENERATE).encode()
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/llm/generate", body, timeout=timeout_s) as r:
        return r.status, json.loads(r.read())


def status(server):
    return json.loads(server.supervisor("/status")[1])


def raw_post(server, path, head, body_wire, timeout_s=60.0):
    """One HTTP/1.1 request written as given (for chunked bodies); (status, body)."""
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=timeout_s) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{head}\r\n".encode())
        s.sendall(body_wire)
        response = http.client.HTTPResponse(s)
        response.begin()
        return response.status, response.read()


def served_meanwhile(server, attack):
    """attack() while another client's generate runs: (attack's result, that request's
    (status, body), its seconds)."""
    meanwhile = {}

    def other():
        t0 = time.monotonic()
        meanwhile["answer"] = generate(server)
        meanwhile["s"] = time.monotonic() - t0

    thread = threading.Thread(target=other)
    thread.start()
    result = attack()
    thread.join(60)
    return result, meanwhile["answer"], meanwhile["s"]


def test_crash_payloads_are_refused_or_defused_and_the_server_keeps_serving(server):
    starts = status(server)["server_starts"]
    assert status(server)["sidecars"]["http-guard"]["state"] == "running"

    # CVE-2025-23311's shape: a 1 MB body of '[', while another client's request is
    # answered in time.
    (code, body), answer, seconds = served_meanwhile(server, lambda: raw_post(
        server, "/v2/models/llm/generate", f"Content-Length: {1 << 20}\r\n", b"[" * (1 << 20)))
    assert code == 400 and b"levels deep" in body
    assert answer[0] == 200 and seconds < 30

    # CVE-2025-23310's shape: 600k one-byte chunks (a real request padded with spaces),
    # the same.
    doc = json.dumps(GENERATE).encode()
    doc = doc[:-1] + b" " * 600_000 + b"}"
    wire = b"".join(b"1\r\n" + doc[i:i + 1] + b"\r\n" for i in range(len(doc))) + b"0\r\n\r\n"
    (code, body), answer, seconds = served_meanwhile(server, lambda: raw_post(
        server, "/v2/models/llm/generate", "Transfer-Encoding: chunked\r\n", wire))
    assert code == 200 and "text_output" in json.loads(body)
    assert answer[0] == 200 and seconds < 30

    # Past the body limit (16 MiB): 413 before it is read.
    code, body = raw_post(server, "/v2/models/llm/generate", f"Content-Length: {64 << 20}\r\n", b"{}")
    assert code == 413

    assert generate(server)[0] == 200
    assert status(server)["server_starts"] == starts            # never restarted
    wait_blocks_free(server)


def test_a_killed_openai_frontend_is_restarted_and_ready_says_so(server):
    base = openai_frontend(server)
    pid = status(server)["sidecars"]["openai"]["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:             # the supervisor polls every 0.25 s
        code, body = server.supervisor("/ready")
        if code == 503:
            break
        assert time.monotonic() < deadline, body
        time.sleep(0.05)
    assert "sidecar 'openai' is " in json.loads(body)["reason"]       # down, or not ready yet
    assert generate(server, timeout_s=30)[0] == 200           # Triton serves on meanwhile
    assert openai_frontend(server, timeout_s=120) == base       # serving again
    s = status(server)
    assert s["sidecars"]["openai"]["restarts"] >= 1 and s["sidecars"]["openai"]["pid"] != pid
    assert s["sidecars"]["openai"]["last_exit"] == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while server.supervisor("/ready")[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert 'llm_sidecar_restarts_total{name="openai"} 1' in server.supervisor("/metrics")[1]


def test_an_unguarded_tritonserver_24_10_dies_on_the_bracket_body(tmp_path):
    """CVE-2025-23311 in the Triton this project runs locally (the pytriton wheel's 24.10):
    1 MiB of `[` to an HTTP route that parses JSON, no key and no model needed, and the
    server dies of SIGSEGV. (Should a newer server survive it, the guard stays harmless
    and this test says the docs need updating.)"""
    import resource
    import subprocess

    from clients.tritonserver import free_port, server_binary
    from supervisor.triton_api import TritonAPI
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    log = open(tmp_path / "tritonserver.log", "w")
    proc = subprocess.Popen([server_binary(), "--model-repository", str(tmp_path), "--model-control-mode", "explicit",
                             "--http-address", "127.0.0.1", "--http-port", str(http_port),
                             "--grpc-address", "127.0.0.1", "--grpc-port", str(grpc_port),
                             "--metrics-address", "127.0.0.1", "--metrics-port", str(metrics_port)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,      # (no core file anywhere else)
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))
    try:
        deadline = time.monotonic() + 60
        while not TritonAPI(f"127.0.0.1:{http_port}").server_ready():
            assert proc.poll() is None and time.monotonic() < deadline, "the bare server did not start"
            time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", http_port), timeout=30) as s:
            s.sendall(f"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: {1 << 20}\r\n\r\n".encode())
            s.sendall(b"[" * (1 << 20))
            try:
                s.recv(1)                   # (the connection ends with the process)
            except OSError:                 # (reset by it)
                pass
        assert proc.wait(timeout=30) == -signal.SIGSEGV
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
