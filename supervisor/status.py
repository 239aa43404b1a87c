"""What the supervisor knows, served on its own port: liveness, readiness, a JSON status
and Prometheus metrics.

Triton's own `/v2/health/live` cannot fail while the server process runs, and during a
server restart its ports are closed; these endpoints stay up through recovery and say why
the backend cannot serve:
 - `GET /live`: 200 while serving or recovering; 503 once recovery has given up (then a
   Kubernetes liveness probe restarts the pod).
 - `GET /ready`: 200 only while serving and tritonserver reports itself ready; else 503.
 - `GET /status`: the state, the last failure and its cause, counts, time to recover.
 - `GET /metrics`: the same as Prometheus counters and gauges.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

STARTING, SERVING, RECOVERING, FAILED, STOPPING = "starting", "serving", "recovering", "failed", "stopping"
STATES = (STARTING, SERVING, RECOVERING, FAILED, STOPPING)


@dataclass
class Failure:
    kind: str        # backend_died | backend_unresponsive | engine_failed | engine_stalled | server_exited
    cause: str
    model: str = ""
    time: float = field(default_factory=time.time)


@dataclass
class SupervisorStatus:
    state: str = STARTING
    reason: str = ""                                  # why not serving, in words
    failures: dict[str, int] = field(default_factory=dict)  # by kind
    recoveries: int = 0
    recovery_attempts: int = 0
    last_failure: Optional[Failure] = None
    last_recovery_s: Optional[float] = None
    server_starts: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def set_state(self, state: str, reason: str = "") -> None:
        with self._lock:
            self.state, self.reason = state, reason

    def on_failure(self, failure: Failure) -> None:
        with self._lock:
            self.failures[failure.kind] = self.failures.get(failure.kind, 0) + 1
            self.last_failure = failure
            self.state, self.reason = RECOVERING, f"recovering from {failure.kind}: {failure.cause}"

    def on_attempt(self) -> None:
        with self._lock:
            self.recovery_attempts += 1

    def on_server_start(self) -> None:
        with self._lock:
            self.server_starts += 1

    def on_recovered(self, seconds: float) -> None:
        with self._lock:
            self.recoveries += 1
            self.last_recovery_s = seconds
            self.state, self.reason = SERVING, ""

    def snapshot(self) -> dict:
        with self._lock:
            return {"state": self.state, "reason": self.reason, "failures": dict(self.failures),
                    "recoveries": self.recoveries, "recovery_attempts": self.recovery_attempts,
                    "last_failure": asdict(self.last_failure) if self.last_failure else None,
                    "last_recovery_s": self.last_recovery_s, "server_starts": self.server_starts}

    def prometheus(self) -> str:
        s = self.snapshot()
        lines = [
            "# HELP llm_backend_failures_total Backend failures detected by the supervisor, by kind.",
            "# TYPE llm_backend_failures_total counter",
            *(f'llm_backend_failures_total{{kind="{k}"}} {n}' for k, n in sorted(s["failures"].items())),
            "# HELP llm_backend_recoveries_total Recoveries that brought the backend back to serving.",
            "# TYPE llm_backend_recoveries_total counter",
            f"llm_backend_recoveries_total {s['recoveries']}",
            "# HELP llm_backend_recovery_attempts_total Tries to recover (reload or server restart).",
            "# TYPE llm_backend_recovery_attempts_total counter",
            f"llm_backend_recovery_attempts_total {s['recovery_attempts']}",
            "# HELP llm_backend_server_starts_total tritonserver processes started (the first included).",
            "# TYPE llm_backend_server_starts_total counter",
            f"llm_backend_server_starts_total {s['server_starts']}",
            "# HELP llm_backend_last_recovery_seconds Time from detecting the last failure to serving again.",
            "# TYPE llm_backend_last_recovery_seconds gauge",
            f"llm_backend_last_recovery_seconds {s['last_recovery_s'] if s['last_recovery_s'] is not None else 'NaN'}",
            "# HELP llm_backend_state 1 for the supervisor's current state.",
            "# TYPE llm_backend_state gauge",
            *(f'llm_backend_state{{state="{st}"}} {int(st == s["state"])}' for st in STATES),
        ]
        last = s["last_failure"]
        if last:
            lines += [
                "# HELP llm_backend_last_failure_info The last failure's kind and cause (value 1).",
                "# TYPE llm_backend_last_failure_info gauge",
                f'llm_backend_last_failure_info{{kind="{last["kind"]}",model="{_escape(last["model"])}",'
                f'cause="{_escape(last["cause"][:300])}"}} 1',
                "# HELP llm_backend_last_failure_timestamp_seconds When the last failure was detected.",
                "# TYPE llm_backend_last_failure_timestamp_seconds gauge",
                f"llm_backend_last_failure_timestamp_seconds {last['time']:.3f}",
            ]
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class StatusServer:
    """The endpoints above on a background thread. `server_ready` asks tritonserver."""

    def __init__(self, port: int, status: SupervisorStatus, server_ready: Callable[[], bool],
                 host: str = "127.0.0.1") -> None:
        status_ref = status

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                s = status_ref.snapshot()
                path = self.path.split("?")[0].rstrip("/")
                if path == "/live":
                    ok = s["state"] != FAILED
                    self._json(200 if ok else 503, {"live": ok, "state": s["state"], "reason": s["reason"]})
                elif path == "/ready":
                    ok = s["state"] == SERVING and server_ready()
                    reason = s["reason"] or ("" if ok else "tritonserver is not ready")
                    self._json(200 if ok else 503, {"ready": ok, "state": s["state"], "reason": reason})
                elif path == "/status":
                    self._json(200, s)
                elif path == "/metrics":
                    self._send(200, status_ref.prometheus().encode(), "text/plain; version=0.0.4")
                else:
                    self._json(404, {"error": f"unknown path {self.path}; try /live, /ready, /status, /metrics"})

            def _json(self, code: int, body: dict) -> None:
                self._send(code, json.dumps(body).encode(), "application/json")

            def _send(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # probes every few seconds: keep the log clean
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="supervisor-http", daemon=True)

    def start(self) -> "StatusServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
