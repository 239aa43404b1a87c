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
import os
from typing import Callable, Optional
from urllib.parse import quote, urlsplit

SERVER_HTTP_ENV = "PAGED_LLM_SERVER_HTTP"     # host:port of tritonserver's HTTP port, reachable here


def http_readiness(address: str, model_name: str, timeout_s: float = 1.0) -> Callable[[], bool]:
    """A probe: True on 200, False on any other status (Triton answers 400 for a model
    that is not ready); raises OSError when the port does not answer (the server is
    stopping, or gone)."""
    parts = urlsplit(f"http://{address}")
    path = f"/v2/models/{quote(model_name, safe='')}/ready"

    def ready() -> bool:
        # (http.client, not urllib: a proxy from the environment must not be used)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            response.read()
            return response.status == 200
        finally:
            conn.close()
    return ready


def readiness_probe(model_name: str, ipc_probe: Callable[[str], bool],
                    environ: Optional[dict] = None) -> Callable[[], bool]:
    """The probe the watcher uses: over HTTP when SERVER_HTTP_ENV is set, else `ipc_probe`."""
    address = (os.environ if environ is None else environ).get(SERVER_HTTP_ENV)
    if address:
        return http_readiness(address, model_name)
    return lambda: bool(ipc_probe(model_name))
