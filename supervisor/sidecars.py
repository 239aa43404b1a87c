"""Processes that serve beside tritonserver (the OpenAI API, the HTTP guard), kept running.

A sidecar that exits is logged with its exit code and started again after a doubling
backoff (1 s up to 30 s; a sidecar that then stays up `stable_after_s` starts its backoff
over). While one is down, the supervisor's `/ready` is 503 and names it, and `/status`
shows each sidecar's state, restarts and last exit: before this, the OpenAI API could die
with nothing restarting it while `/ready` stayed 200.
"""

from __future__ import annotations

import logging
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from supervisor.triton_api import http_request

log = logging.getLogger("supervisor")


@dataclass
class Sidecar:
    name: str                           # e.g. "openai", "http-guard"
    command: list[str]
    env: dict[str, str]
    ready_url: str = ""                 # answers 200 once the sidecar serves (checked by /ready)
    proc: Optional[subprocess.Popen] = None
    restarts: int = 0
    last_exit: Optional[int] = None
    next_start: float = 0.0             # monotonic time of the next try while down
    backoff_s: float = 1.0
    started_at: float = 0.0

    def running(self) -> Optional[subprocess.Popen]:
        """Its process while it runs. One read of `proc`: the status port's thread asks
        while the supervisor's poll() may clear it."""
        proc = self.proc
        return proc if proc is not None and proc.poll() is None else None

    @property
    def up(self) -> bool:
        return self.running() is not None

    def snapshot(self) -> dict:
        proc = self.running()
        return {"state": "running" if proc else "down", "pid": proc.pid if proc else None,
                "restarts": self.restarts, "last_exit": self.last_exit}


@dataclass
class Sidecars:
    sidecars: list[Sidecar] = field(default_factory=list)
    max_backoff_s: float = 30.0
    stable_after_s: float = 60.0
    popen: Callable[..., subprocess.Popen] = subprocess.Popen

    def start(self) -> None:
        for s in self.sidecars:
            self._spawn(s)

    def poll(self) -> None:
        """Notice an exit (once), and restart what is due. Called from the supervisor's loop."""
        now = time.monotonic()
        for s in self.sidecars:
            if s.up:
                if now - s.started_at > self.stable_after_s:
                    s.backoff_s = 1.0
                continue
            if s.proc is not None:          # just found dead
                s.last_exit = s.proc.returncode
                s.proc = None
                s.next_start = now + s.backoff_s
                log.error("sidecar '%s' exited with code %s; restarting in %.0fs", s.name, s.last_exit, s.backoff_s)
                s.backoff_s = min(s.backoff_s * 2, self.max_backoff_s)
            elif now >= s.next_start:
                s.restarts += 1
                self._spawn(s)

    def not_ready(self) -> str:
        """Why a running sidecar does not serve yet, in words ("" when all do): `/ready`
        asks each one's ready_url, so that it turns 200 only once the OpenAI API does too
        (it answered 503 for about 3 s after tritonserver was ready)."""
        for s in self.sidecars:
            if s.up and s.ready_url:
                status, _ = http_request(s.ready_url, timeout_s=2.0)
                if status != 200:
                    return f"sidecar '{s.name}' is not ready yet ({s.ready_url} answered {status or 'nothing'})"
        return ""

    def snapshot(self) -> dict[str, dict]:
        return {s.name: s.snapshot() for s in self.sidecars}

    def _spawn(self, s: Sidecar) -> None:
        try:
            s.proc = self.popen(s.command, env=s.env)
            s.started_at = time.monotonic()
            log.info("sidecar '%s' started (pid %d)", s.name, s.proc.pid)
        except OSError as e:                # EMFILE, ENOMEM: try again later
            log.error("sidecar '%s' could not start: %s", s.name, e)
            s.proc, s.next_start = None, time.monotonic() + s.backoff_s

    def stop(self, timeout_s: float = 10.0) -> None:
        for s in self.sidecars:
            if s.up:
                s.proc.terminate()
        for s in self.sidecars:
            if s.proc is None:
                continue
            try:
                s.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:   # a client holding a connection open
                s.proc.kill()
                s.proc.wait()
