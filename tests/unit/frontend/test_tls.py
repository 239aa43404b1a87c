"""The OpenAI frontend serves HTTPS with --ssl-certfile/--ssl-keyfile (uvicorn's), started
as its own process (`python -m frontend.openai_api`). No tritonserver behind it: /health
answers 503 over TLS, which is all this needs; a plain-HTTP client gets no answer."""

import http.client
import os
import ssl
import subprocess
import sys
import time

import pytest

from clients.tritonserver import ROOT, free_port
from tests.helpers.certs import self_signed


def test_frontend_serves_https(tmp_path):
    cert, key = self_signed(tmp_path)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("API_KEY", "TRITON_ADMIN"))}
    proc = subprocess.Popen([sys.executable, "-m", "frontend.openai_api", "--port", str(port), "--triton-url",
                             "127.0.0.1:1", "--ssl-certfile", cert, "--ssl-keyfile", key, "--api-key", "k" * 20],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        context = ssl.create_default_context(cafile=cert)
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=5)
                conn.request("GET", "/health")
                response = conn.getresponse()
                status = response.status
                response.read()
                break
            except (ConnectionRefusedError, ConnectionResetError):
                assert time.monotonic() < deadline and proc.poll() is None, "the frontend did not start"
                time.sleep(0.2)
        assert status == 503                                    # TLS works; no tritonserver behind it
        conn.request("GET", "/v1/models")
        assert conn.getresponse().status == 401                 # and the key is still asked for
        conn.close()
        plain = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            plain.request("GET", "/health")
            plain.getresponse()
        plain.close()
        untrusting = http.client.HTTPSConnection("127.0.0.1", port, context=ssl.create_default_context(), timeout=5)
        with pytest.raises(ssl.SSLCertVerificationError):       # a client that does not trust it
            untrusting.request("GET", "/health")
        untrusting.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
