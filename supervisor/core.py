"""Runs tritonserver as a child, watches our models' backend processes, and recovers.

Detect (every `poll_interval_s`), from the stubs' health reports (backend/triton_server/
health_report.py) and /proc:
 - backend_died: a stub vanished without reporting `stopped` (OOM killer, CUDA fault,
   native crash, SIGKILL);
 - backend_unresponsive: its heartbeat is older than its stall timeout (a hang that holds
   the GIL, so its own watchdog cannot run);
 - engine_failed / engine_stalled: the stub reports it (its watchdog saw the engine loop
   die, or wait with work and no step for `engine_stall_timeout_s`);
 - server_exited: tritonserver itself ended, its stubs still running (one already gone
   makes it backend_died: Triton's python backend can abort the server on a stub killed
   mid-call, faster than a poll).

Recover:
 - engine_failed / engine_stalled: the stub has already failed its in-flight requests and
   unloaded itself; unload (idempotent) and load the model through Triton's repository API.
 - The others restart tritonserver. Triton 24.10's python backend cannot end the
   decoupled requests of a dead stub (they hang until the server exits), nor finish
   unloading that model (shutdown then waits out `--exit-timeout-secs`): only the end
   of the server process ends those streams. Other models' stubs get SIGTERM's drain first.
 A try that fails is retried after a doubling backoff (a failed reload escalates to a
 server restart); after `max_tries` the supervisor gives up: the server stays down and
 `/live` fails with the reason.

Sidecars (the OpenAI API, the HTTP guard: supervisor/sidecars.py) are restarted whenever
they exit, and keep `/ready` at 503 while down.

File descriptors: the soft limit is raised to the hard one at start, and a poll that
fails with an OSError (EMFILE under a connection flood) is logged and retried on the next
tick instead of ending the supervisor and orphaning tritonserver.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from backend.triton_server.health_report import HEALTH_DIR_ENV, SERVING, STOPPED, UNHEALTHY, read_reports
from supervisor import processes
from supervisor.sidecars import Sidecar, Sidecars
from supervisor.status import FAILED, SERVING as STATE_SERVING, STOPPING, Failure, StatusServer, SupervisorStatus
from supervisor.triton_api import TritonAPI

log = logging.getLogger("supervisor")
RESTART_KINDS = ("backend_died", "backend_unresponsive", "server_exited")
# A stub writes its heartbeat every 0.5 s. One this old is hung (SIGSTOP, a native call
# holding the GIL), or busy past what a client should wait for: `/ready` says 503 at
# once, long before its stall timeout has the supervisor kill it (a hung stub answered
# "Stub process is not healthy" for 20 s while `/ready` stayed 200).
NOT_READY_AFTER_S = 5.0


@dataclass
class SupervisorOptions:
    command: list[str]                  # tritonserver and its arguments
    env: dict[str, str]
    http_port: int                      # tritonserver's HTTP port (health, repository API)
    port: int = 8003                    # the supervisor's own endpoints
    host: str = "127.0.0.1"             # where the supervisor's endpoints listen
    triton_host: str = "127.0.0.1"      # where this machine reaches tritonserver's HTTP port
    admin_headers: dict[str, str] = field(default_factory=dict)  # for the restricted repository API
    poll_interval_s: float = 0.25
    max_tries: int = 3
    backoff_s: float = 1.0
    startup_timeout_s: float = 900.0
    drain_timeout_s: float = 30.0       # other models' drain before a restart kills the server
    kill_after_stubs_exit_s: float = 3.0
    # Where the backend's stubs write their health reports. Empty: a temporary folder
    # made when the Supervisor is built (not when the options are: a test or a config
    # check builds options it never runs, and each left a folder behind).
    health_dir: str = ""
    sidecars: list[Sidecar] = field(default_factory=list)


class Supervisor:
    def __init__(self, options: SupervisorOptions) -> None:
        if not options.health_dir:
            options = dataclasses.replace(options, health_dir=tempfile.mkdtemp(prefix="paged_llm_health_"))
        self.o = options
        self.api = TritonAPI(f"{options.triton_host}:{options.http_port}", options.admin_headers)
        self.status = SupervisorStatus()
        self.proc: Optional[subprocess.Popen] = None
        self._stop = threading.Event()
        self._handled: set[int] = set()       # stub pids whose failure was dealt with
        self._stubs: dict[int, processes.Stub] = {}  # seen for this server process, for cleanup
        self._server_lifetime: tuple[int, Optional[int]] = (0, None)    # (start, end) in boot clock ticks
        self._next_scan = 0.0
        self.sidecars = Sidecars(options.sidecars)

    # ---------------------------------------------------------------- main
    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stop.set())
        raise_fd_limit()
        http = StatusServer(self.o.port, self.status, self.api.server_ready, self.o.host,
                            not_ready=self.sidecars.not_ready, backend_not_ready=self.backend_not_ready).start()
        self.sidecars.start()
        self.status.set_sidecars(self.sidecars.snapshot())
        try:
            if not self._start_server():
                if self._stop.is_set():  # Ctrl-C while loading: let Triton stop on its own terms
                    return self.shutdown()
                log.error("tritonserver did not start; giving up")
                self._stop_server(force=True)
                return 1
            self.status.set_state(STATE_SERVING)
            while not self._stop.wait(self.o.poll_interval_s):
                try:
                    self.tick()
                except OSError as e:        # EMFILE and the like: the next tick tries again
                    log.error("supervisor poll failed: %s", e)
            return self.shutdown()
        finally:
            self.sidecars.stop()
            http.stop()
            shutil.rmtree(self.o.health_dir, ignore_errors=True)

    def tick(self) -> None:
        self.sidecars.poll()
        self.status.set_sidecars(self.sidecars.snapshot())
        if self.status.state == FAILED:
            return
        self._scan_stubs()
        failure = self.check()
        if failure is not None:
            self.recover(failure)

    def backend_not_ready(self) -> str:
        """Why the backend should not take requests though tritonserver says ready: a stub
        whose heartbeat is late, in words ("" when none is). `/ready` also asks the
        sidecars (Sidecars.not_ready)."""
        for r in read_reports(self.o.health_dir).values():
            late = time.time() - r.time
            if r.state == SERVING and r.pid not in self._handled and late > min(NOT_READY_AFTER_S,
                                                                               r.stale_after_s / 2):
                return f"the backend process of '{r.instance}' (pid {r.pid}) has sent no heartbeat for {late:.0f}s"
        return ""

    def check(self) -> Optional[Failure]:
        exited = self.proc is None or self.proc.poll() is not None
        server_exit = f"tritonserver exited with code {None if self.proc is None else self.proc.returncode}"
        for r in read_reports(self.o.health_dir).values():
            if r.pid in self._handled:
                continue
            failure = None
            if r.state == SERVING and not processes.alive(r.pid, r.instance):
                # Found with the server exited, the stub died first: Triton's python backend
                # can abort the server on a stub killed mid-call (a boost::interprocess
                # lock_exception), faster than a poll, while a server that ends on its own
                # leaves its stubs running until they notice.
                then = f", then {server_exit}" if exited else ""
                failure = Failure("backend_died", f"the backend process of '{r.instance}' (pid {r.pid}) "
                                  f"exited without stopping{then}", r.model)
            elif exited:
                continue
            elif r.state == UNHEALTHY:
                failure = Failure(r.kind or "engine_failed", r.cause, r.model)
            elif r.state == SERVING and time.time() - r.time > r.stale_after_s:
                failure = Failure("backend_unresponsive", f"the backend process of '{r.instance}' (pid {r.pid}) "
                                  f"sent no heartbeat for {time.time() - r.time:.0f}s", r.model)
                processes.kill(r.pid)
            if failure is not None:
                self._handled.add(r.pid)
                return failure
        return Failure("server_exited", server_exit) if exited else None

    # ------------------------------------------------------------- recover
    def recover(self, failure: Failure) -> None:
        log.error("backend failure (%s): %s", failure.kind, failure.cause)
        self.status.on_failure(failure)
        t0 = time.monotonic()
        restart = failure.kind in RESTART_KINDS
        for attempt in range(1, self.o.max_tries + 1):
            if self._stop.is_set():
                return
            self.status.on_attempt()
            how = "restarting tritonserver" if restart else f"reloading model '{failure.model}'"
            log.warning("recovery try %d/%d (%s): %s", attempt, self.o.max_tries, failure.kind, how)
            ok = self._restart_server() if restart else self._reload(failure.model)
            if ok:
                seconds = time.monotonic() - t0
                self.status.on_recovered(seconds)
                log.warning("recovered from %s in %.1fs", failure.kind, seconds)
                return
            restart = True  # a reload that failed (or hung on a dead instance) escalates
            if attempt < self.o.max_tries:  # no wait before giving up
                self._stop.wait(min(self.o.backoff_s * 2 ** (attempt - 1), 30.0))
        reason = f"gave up after {self.o.max_tries} tries to recover from {failure.kind}: {failure.cause}"
        log.error(reason)
        self._stop_server(force=True)
        self.status.set_state(FAILED, reason)

    def _reload(self, model: str) -> bool:
        self.api.unload(model)
        deadline = time.monotonic() + 30.0
        while (state := self.api.model_state(model)) in ("READY", "UNLOADING") and time.monotonic() < deadline:
            time.sleep(0.1)
        if state in ("READY", "UNLOADING"):
            log.error("model '%s' did not finish unloading", model)
            return False
        ok, body = self.api.load(model, self.o.startup_timeout_s)
        if not ok:
            log.error("loading '%s' failed: %s", model, body)
        self._next_scan = 0.0
        return ok and self.api.model_ready(model)

    def _restart_server(self) -> bool:
        self._stop_server(force=False)
        return self._start_server()

    # -------------------------------------------------------------- server
    def _start_server(self) -> bool:
        for name in os.listdir(self.o.health_dir):  # a fresh server: old reports mean nothing
            os.remove(os.path.join(self.o.health_dir, name))
        env = {**self.o.env, HEALTH_DIR_ENV: self.o.health_dir}
        self.proc = subprocess.Popen(self.o.command, env=env)
        # Its lifetime bounds which stubs are its (a pid is reused once it is gone).
        self._server_lifetime = (processes.start_ticks(self.proc.pid), None)
        self.status.on_server_start()
        self._stubs.clear()
        deadline = time.monotonic() + self.o.startup_timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            if self.proc.poll() is not None:
                log.error("tritonserver exited with code %s while starting", self.proc.returncode)
                return False
            if self.api.server_ready(timeout_s=1.0):
                self._next_scan = 0.0
                self._scan_stubs()
                return True
            time.sleep(0.25)
        return False

    def _scan_stubs(self) -> None:
        """Remember the server's stubs (every 2 s, and after loads): a killed server
        leaves their shared memory behind."""
        if self.proc is None or time.monotonic() < self._next_scan:
            return
        self._next_scan = time.monotonic() + 2.0
        start, end = self._server_lifetime
        if end is None and self.proc.poll() is not None:
            self._server_lifetime = (start, end := processes.now_ticks())
        for stub in processes.stubs_of(self.proc.pid, (start, end)):
            self._stubs[stub.pid] = stub

    def _live_stubs(self) -> list[int]:
        """The stubs a drain or a shutdown waits for: serving and alive, less those tied to
        a dead stub by requests between models (a TensorRT-LLM front and its `llm`). Triton
        24.10 never ends the streams a front of a dead `llm` waits on, nor releases the
        requests a dead front sent to `llm` (so `llm` never finishes unloading): either
        would hold the wait up to its timeout."""
        reports = list(read_reports(self.o.health_dir).values())
        live = {r.pid for r in reports
                if r.state == SERVING and r.pid not in self._handled and processes.alive(r.pid, r.instance)}
        dead = [r for r in reports if r.state != STOPPED and r.pid not in live]
        dead_models, called_by_dead = {r.model for r in dead}, {r.calls for r in dead}
        return [r.pid for r in reports
                if r.pid in live and r.calls not in dead_models and r.model not in called_by_dead]

    def _stop_server(self, force: bool) -> None:
        """Let the other models' stubs drain (SIGTERM), then kill the server and clean up."""
        if self.proc is not None and self.proc.poll() is None:
            if not force and self._live_stubs():
                self.proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + self.o.drain_timeout_s
                while self._live_stubs() and self.proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.1)
            self.proc.kill()
            self.proc.wait()
        self._cleanup_stubs()

    def _cleanup_stubs(self) -> None:
        if self.proc is not None:       # (and those started, or left behind, since the last scan)
            self._next_scan = 0.0
            self._scan_stubs()
        for stub in self._stubs.values():
            processes.end_stub(stub)
        self._stubs.clear()

    # ------------------------------------------------------------ shutdown
    def shutdown(self) -> int:
        """SIGTERM lets Triton drain and unload every model. A model whose stub died
        never finishes unloading, so once no stub of ours is alive the server gets
        `kill_after_stubs_exit_s` to exit on its own, then is killed: there is nothing
        left to wait for."""
        self.status.set_state(STOPPING, "shutting down")
        if self.proc is None or self.proc.poll() is not None:
            self._cleanup_stubs()
            return 0 if self.proc is None else self.proc.returncode
        self._scan_stubs()
        self.proc.send_signal(signal.SIGTERM)
        quiet_since: Optional[float] = None
        while self.proc.poll() is None:
            if self._live_stubs():
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > self.o.kill_after_stubs_exit_s:
                log.warning("every model has stopped but tritonserver has not exited; killing it")
                self.proc.kill()
                self.proc.wait()
                self._cleanup_stubs()
                return 0
            time.sleep(0.1)
        self._cleanup_stubs()
        return self.proc.returncode


def raise_fd_limit() -> None:
    """Soft descriptor limit up to the hard one: Python's default keeps the soft 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = max(soft, 65536) if hard == resource.RLIM_INFINITY else hard
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass
