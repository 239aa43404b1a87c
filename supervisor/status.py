"""What the supervisor knows, served on its own port: liveness, readiness, a JSON status
and Prometheus metrics.

Triton's own `/v2/health/live` cannot fail while the server process runs, and during a
server restart its ports are closed; these endpoints stay up through recovery and say why
the backend cannot serve:
 - `GET /live`: 200 while serving or recovering; 503 once recovery has given up (then a
   Kubernetes liveness probe restarts the pod).
 - `GET /ready`: 200 only while serving, tritonserver reports itself ready, every
   backend process has sent a heartbeat within 5 s (core.NOT_READY_AFTER_S: a hung one
   makes requests fail long before the supervisor kills it), and every sidecar (the
   OpenAI API, the HTTP guard) runs and serves; else 503 with the reason. Its
   `backend_ready` and `backend_reason` leave the sidecars out; `GET /ready?scope=backend`
   answers for the backend alone (the OpenAI frontend asks it every 0.5 s to fail fast
   while the backend cannot serve).
 - `GET /status`: the state, the last failure and its cause, counts, time to recover,
   and each sidecar's state and restarts.
 - `GET /metrics`: the same as Prometheus counters and gauges.

The port takes at most MAX_CONNECTIONS connections at a time, MAX_PER_CLIENT from one
address, each with a read timeout and a deadline for the whole request: one thread per
idle connection, unbounded, used to exhaust the supervisor's file descriptors (about
1,000 idle connections at a 1,024 limit) until it exited, and a client trickling a byte
a second could hold a slot for ever.
"""

from __future__ import annotations

import json
import socket
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
    sidecars: dict[str, dict] = field(default_factory=dict)   # name -> Sidecar.snapshot()
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

    def set_sidecars(self, sidecars: dict[str, dict]) -> None:
        with self._lock:
            self.sidecars = sidecars

    def sidecars_down(self) -> str:
        """Why the sidecars keep the server from being ready, in words; "" when all run."""
        with self._lock:
            down = [f"sidecar '{n}' is down (last exit code {s['last_exit']})"
                    for n, s in self.sidecars.items() if s["state"] != "running"]
        return "; ".join(down)

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
                    "last_recovery_s": self.last_recovery_s, "server_starts": self.server_starts,
                    "sidecars": {n: dict(v) for n, v in self.sidecars.items()}}

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
            "# HELP llm_sidecar_up 1 while the sidecar process (the OpenAI API, the HTTP guard) runs.",
            "# TYPE llm_sidecar_up gauge",
            *(f'llm_sidecar_up{{name="{n}"}} {int(v["state"] == "running")}' for n, v in s["sidecars"].items()),
            "# HELP llm_sidecar_restarts_total Times the supervisor started a sidecar again after it exited.",
            "# TYPE llm_sidecar_restarts_total counter",
            *(f'llm_sidecar_restarts_total{{name="{n}"}} {v["restarts"]}' for n, v in s["sidecars"].items()),
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


MAX_CONNECTIONS = 256
MAX_PER_CLIENT = 16
READ_TIMEOUT_S = 2.0
REQUEST_DEADLINE_S = 5.0


class _BoundedServer(ThreadingHTTPServer):
    """A thread a connection, at most MAX_CONNECTIONS: one more is closed at once, so
    idle connections hold neither threads nor file descriptors past the bound."""
    daemon_threads = True
    # A deep listen backlog: one client's flood of connections (each closed at once past
    # its share) must not fill it, or a probe's SYN is dropped and retried a second later.
    request_queue_size = 1024

    def __init__(self, server_address: tuple[str, int], *args, **kwargs) -> None:
        # The class's AF_INET cannot bind an IPv6 literal such as `--host ::1`.
        if ":" in server_address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(server_address, *args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._per_client: dict[str, int] = {}
        self._lock = threading.Lock()

    def _take(self, client: str) -> bool:
        with self._lock:
            if self._per_client.get(client, 0) >= MAX_PER_CLIENT or not self._slots.acquire(blocking=False):
                return False
            self._per_client[client] = self._per_client.get(client, 0) + 1
            return True

    def _give(self, client: str) -> None:
        with self._lock:
            self._per_client[client] -= 1
            if not self._per_client[client]:
                del self._per_client[client]
            self._slots.release()

    def process_request(self, request, client_address) -> None:
        if not self._take(client_address[0]):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._give(client_address[0])
            raise

    def process_request_thread(self, request, client_address) -> None:
        # The whole request within its deadline, however slowly it trickles in.
        deadline = threading.Timer(REQUEST_DEADLINE_S, _cut, (request,))
        deadline.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            deadline.cancel()
            self._give(client_address[0])

    def handle_error(self, request, client_address) -> None:
        pass                                # a reset or timed-out probe: nothing to log

    def get_request(self):
        try:
            return super().get_request()
        except OSError:                     # accept() at the descriptor limit: the caller skips
            time.sleep(0.05)                # this one; wait rather than spin on the listener
            raise


def _cut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class StatusServer:
    """The endpoints above on a background thread. `server_ready` asks tritonserver."""

    def __init__(self, port: int, status: SupervisorStatus, server_ready: Callable[[], bool],
                 host: str = "127.0.0.1", not_ready: Callable[[], str] = lambda: "",
                 backend_not_ready: Callable[[], str] = lambda: "") -> None:
        """Why the server should not take requests though tritonserver says it is ready
        ("" when nothing stops it): `backend_not_ready` for the backend processes (a hung
        stub), `not_ready` for the rest (a sidecar not serving yet)."""
        status_ref = status

        class Handler(BaseHTTPRequestHandler):
            timeout = READ_TIMEOUT_S        # an idle or slow connection is dropped

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                s = status_ref.snapshot()
                path = self.path.split("?")[0].rstrip("/")
                if path == "/live":
                    ok = s["state"] != FAILED
                    self._json(200 if ok else 503, {"live": ok, "state": s["state"], "reason": s["reason"]})
                elif path == "/ready":
                    serving = s["state"] == SERVING
                    # In the most specific words: a stub's late heartbeat also explains a
                    # tritonserver that has turned not ready (it pings its stubs too).
                    late = backend_not_ready() if serving else ""
                    # backend_*: what the OpenAI frontend (a sidecar itself) reads to fail
                    # fast (backend_health.py), asking `?scope=backend` (no sidecar is
                    # asked then): a backend process hung, or the backend being recovered.
                    # Not starting or stopping (a drain lets requests finish), nor Triton's
                    # own readiness (false while any model loads).
                    backend = late or (s["reason"] if s["state"] in (RECOVERING, FAILED) else "")
                    fields = {"backend_ready": not backend, "backend_reason": backend}
                    if "scope=backend" in self.path:
                        self._json(200 if not backend else 503,
                                   {"ready": not backend, "state": s["state"], "reason": backend, **fields})
                        return
                    down = status_ref.sidecars_down()
                    waiting = (late or not_ready()) if serving and not down else ""
                    ok = serving and not down and not waiting and server_ready()
                    reason = s["reason"] or down or waiting or ("" if ok else "tritonserver is not ready")
                    self._json(200 if ok else 503, {"ready": ok, "state": s["state"], "reason": reason, **fields})
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

        self.httpd = _BoundedServer((host, port), Handler)
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="supervisor-http", daemon=True)

    def start(self) -> "StatusServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
