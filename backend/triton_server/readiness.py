"""Is this model still ready? The watcher's question, asked over the server's own HTTP
port when the launcher says where that is, else through the python backend's IPC.

Why not always `pb_utils.is_model_ready`: in Triton 24.10 that call, made while the
server begins to stop, crashes the stub (SIGSEGV in the shared-memory allocator,
`ModelLoader::SendModelReadinessRequest` -> `Stub::SendMessage` -> `priv_deallocate`,
seen in the cores of 2 of 2 crashed stubs). With a stream open at SIGTERM it did so in
about half of the attempts, and with no probe at all in none of 8: the backend never
drained, the stream was not ended, and the server waited out its exit timeout
(docs/reliability.md). An HTTP request to `/v2/models/NAME/ready` asks Triton the same
question without the stub's IPC. The launcher (`clients/tritonserver.py`) puts the
address in SERVER_HTTP_ENV; without it (tritonserver started by other means) the IPC
call is the only way.
"""

from __future__ import annotations

import http.client
import logging
import os
from typing import Callable, Optional
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

SERVER_HTTP_ENV = "PAGED_LLM_SERVER_HTTP"     # host:port of tritonserver's HTTP port, reachable here
# What a URL path holds as it is: Triton matches its routes on the raw path and never
# decodes %-escapes, so a model name is sent unescaped, and one that would need escaping
# (space, %, ?, #, other characters) is asked about through the IPC call instead.
_PATH_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~!$&'()*+,;=:@")


class ReadinessAnswerError(OSError):
    """An HTTP answer that is neither ready (200) nor not ready (400)."""


def http_readiness(address: str, model_name: str, timeout_s: float = 1.0) -> Callable[[], bool]:
    """A probe: True on 200, False on 400 (Triton's answer for a model that is not
    ready); raises OSError when the port does not answer (the server is stopping, or
    gone) or answers anything else. ValueError at once for an address or a name it
    cannot ask about."""
    parts = urlsplit(f"http://{address}")
    host, port = parts.hostname, parts.port         # (raises ValueError for a bad port)
    if not host or not port:
        raise ValueError(f"{SERVER_HTTP_ENV}={address!r} is not HOST:PORT")
    if not model_name or not set(model_name) <= _PATH_SAFE:
        raise ValueError(f"the model name {model_name!r} cannot be written in a URL path as it is")
    path = f"/v2/models/{model_name}/ready"

    def ready() -> bool:
        # (http.client, not urllib: a proxy from the environment must not be used)
        conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            response.read()
        finally:
            conn.close()
        if response.status in (200, 400):
            return response.status == 200
        raise ReadinessAnswerError(f"GET {path} answered {response.status}")
    return ready


def readiness_probe(model_name: str, ipc_probe: Callable[[str], bool],
                    environ: Optional[dict] = None) -> Callable[[], bool]:
    """The probe the watcher uses. Over HTTP when SERVER_HTTP_ENV is set, but trusted only
    once it has answered 200: until then (a wrong address, HTTP turned off, the health
    API restricted) each question goes to `ipc_probe` as well, so that a misconfigured
    address can never drain a healthy model. Without the variable, or with one that
    cannot be used: `ipc_probe` alone."""
    ipc = lambda: bool(ipc_probe(model_name))           # noqa: E731
    address = (os.environ if environ is None else environ).get(SERVER_HTTP_ENV)
    if not address:
        return ipc
    try:
        http_ready = http_readiness(address, model_name)
    except ValueError as e:
        logger.warning("readiness asked through the python backend's IPC: %s", e)
        return ipc
    trusted = []

    def ready() -> bool:
        if trusted:
            return http_ready()
        try:
            if http_ready():
                trusted.append(True)
                return True
        except OSError:
            pass
        return ipc()
    return ready
