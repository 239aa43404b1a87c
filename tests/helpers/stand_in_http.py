"""A stand-in HTTP server on a loopback port for a client under test: `answer(path, body)`
gives each POST's status (the body decoded from JSON)."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterator


@contextmanager
def stand_in_server(answer: Callable[[str, dict, dict], int]) -> Iterator[str]:
    """Yields the server's URL; `answer(path, headers (lower-case names), body)` -> the status (an
    empty body)."""
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            self.send_response(answer(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
