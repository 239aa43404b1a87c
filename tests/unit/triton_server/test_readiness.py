"""backend/triton_server/readiness.py: the watcher's readiness probe, over the server's
HTTP port when the launcher gives its address, else through the stub's IPC call."""

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from backend.triton_server.readiness import SERVER_HTTP_ENV, http_readiness, readiness_probe


@pytest.fixture
def triton_like():
    """An HTTP server answering /v2/models/NAME/ready as Triton does: 200 or 400."""
    state = {"ready": True, "paths": []}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            state["paths"].append(self.path)
            self.send_response(200 if state["ready"] else 400)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}", state
    server.shutdown()
    server.server_close()


def test_http_probe_reads_the_models_readiness(triton_like):
    address, state = triton_like
    probe = http_readiness(address, "llm/x")
    assert probe() is True
    state["ready"] = False
    assert probe() is False
    assert state["paths"] == ["/v2/models/llm%2Fx/ready"] * 2      # (the name quoted)


def test_http_probe_raises_when_the_port_is_closed(triton_like):
    address, _ = triton_like
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"                  # bound, not listening
    with pytest.raises(OSError):
        http_readiness(closed, "llm", timeout_s=0.5)()


def test_the_launchers_address_chooses_http_else_the_ipc_call(triton_like, monkeypatch):
    address, state = triton_like
    asked = []

    def ipc(name):
        asked.append(name)
        return True
    assert readiness_probe("llm", ipc, {SERVER_HTTP_ENV: address})() is True
    assert asked == [] and state["paths"] == ["/v2/models/llm/ready"]
    assert readiness_probe("llm", ipc, {})() is True and asked == ["llm"]
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")           # never through a proxy
    assert readiness_probe("llm", ipc, {SERVER_HTTP_ENV: address})() is True
