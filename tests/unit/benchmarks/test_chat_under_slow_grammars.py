"""benchmarks/chat_under_slow_grammars.py end to end against a stand-in OpenAI server (its
figures come from runs against `make serve`: docs/security.md, item 9)."""

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from benchmarks import chat_under_slow_grammars


def test_times_plain_chat_alone_during_and_after_the_slow_schemas(capsys):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            slow = "response_format" in body
            if slow:
                time.sleep(0.3)
            self.send_response(400 if slow else 200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        chat_under_slow_grammars.main(["--url", f"http://127.0.0.1:{server.server_address[1]}", "--slow", "2",
                                       "--seconds", "0.2", "0.2", "0.2"])
    finally:
        server.shutdown()
    out = capsys.readouterr().out
    for phase in ("alone", "during", "after"):
        assert re.search(rf"plain {phase} *n=\d+ p50=\d+ ms max=\d+ ms codes=\[200\]", out), out
    assert "slow schemas [400] [0.3, 0.3]" in out
