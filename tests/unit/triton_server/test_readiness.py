"""backend/triton_server/readiness.py: the watcher's readiness probe, over the server's
HTTP port when the launcher gives its address, else through the stub's IPC call."""

import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from backend.triton_server.readiness import SERVER_HTTP_ENV, http_readiness, readiness_probe


@pytest.fixture
def triton_like():
    """An HTTP server answering /v2/models/NAME/ready as Triton does (200 or 400), or with
    the status in state["status"]."""
    state = {"status": 200, "paths": []}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            state["paths"].append(self.path)
            self.send_response(state["status"])
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}", state
    server.shutdown()
    server.server_close()


def closed_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"           # closed once this returns


def test_http_probe_reads_the_models_readiness(triton_like):
    address, state = triton_like
    probe = http_readiness(address, "qwen2.5:7b")
    assert probe() is True
    state["status"] = 400
    assert probe() is False
    state["status"] = 403                                    # neither answer: a failure
    with pytest.raises(OSError):
        probe()
    # Triton matches the raw path and never decodes %-escapes: the name goes as it is.
    assert state["paths"] == ["/v2/models/qwen2.5:7b/ready"] * 3


def test_http_probe_raises_when_the_port_is_closed():
    with pytest.raises(OSError):
        http_readiness(closed_address(), "llm", timeout_s=0.5)()


def test_http_probe_refuses_what_it_cannot_ask():
    for address, name in (("[::1", "llm"), ("127.0.0.1", "llm"), ("127.0.0.1:8000", "my model"),
                          ("127.0.0.1:8000", "a%2Fb"), ("127.0.0.1:8000", "")):
        with pytest.raises(ValueError):
            http_readiness(address, name)


class Ipc:
    def __init__(self, answer=True):
        self.answer, self.asked = answer, 0

    def __call__(self, name):
        self.asked += 1
        return self.answer


def test_http_is_trusted_once_it_said_ready_and_never_drains_a_model_before(triton_like, monkeypatch):
    address, state = triton_like
    ipc = Ipc()
    probe = readiness_probe("llm", ipc, {SERVER_HTTP_ENV: address})
    state["status"] = 403              # (say, the health API restricted): the IPC call answers
    assert probe() is True and ipc.asked == 1
    state["status"] = 200
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # never through a proxy
    assert probe() is True and ipc.asked == 1
    state["status"] = 400              # trusted now: its answer stands
    assert probe() is False and ipc.asked == 1


def test_a_wrong_or_unusable_address_falls_back_to_the_ipc_call():
    ipc = Ipc()
    assert readiness_probe("llm", ipc, {SERVER_HTTP_ENV: closed_address()})() is True and ipc.asked == 1
    assert readiness_probe("llm", ipc, {SERVER_HTTP_ENV: "[::1"})() is True and ipc.asked == 2
    assert readiness_probe("my model", ipc, {SERVER_HTTP_ENV: "127.0.0.1:1"})() is True and ipc.asked == 3
    assert readiness_probe("llm", ipc, {})() is True and ipc.asked == 4
