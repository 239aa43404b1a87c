"""Fail fast while the model's backend cannot serve (issue 49 item 10).

A backend process hung (SIGSTOP, a native call holding the GIL) keeps tritonserver's
model ready, and Triton puts no bound of its own on the requests in its hands: the red
team's streams stalled 24 s before a 503, and here one had not ended 45 s later. The
supervisor sees the hang from the process's heartbeat (late past 5 s) and its recoveries:
its `/ready?scope=backend` then turns 503 (supervisor/status.py; not while the server
starts or drains, nor while a model loads). Under the supervisor
(`--backend-health-url`, which `python -m clients.tritonserver` passes), this watch
reads that answer every `interval_s`; while the backend is not ready:
- a new request gets a 503 at once, naming the cause (retryable: the supervisor is
  recovering the backend);
- generation requests waiting on Triton end with the same 503 (a stream: its error
  event) and their Triton requests are cancelled; not one whose end Triton has already
  sent (backend errors keep their own words), nor embeddings already sent (a prompt's
  forward) or the admin routes (LoRA, sleep).

A supervisor that cannot be reached changes nothing: the frontend then serves as it does
without one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from typing import Optional

from frontend.openai_api.errors import APIError
from supervisor.triton_api import http_request

log = logging.getLogger("frontend")


class BackendHealth:
    def __init__(self, url: str, interval_s: float = 0.5, timeout_s: float = 1.0) -> None:
        self.url = url
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.reason = ""                # why the backend cannot serve ("": it can, or unknown)
        self._live: "weakref.WeakSet" = weakref.WeakSet()
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def error(self) -> APIError:
        return APIError(503, f"the model's backend cannot serve now (being recovered); retry: {self.reason}")

    def check(self) -> None:
        """Raises the 503 while the backend cannot serve."""
        if self.reason:
            raise self.error()

    def watch(self, generation) -> None:
        """A request sent to Triton: failed with the 503 if the backend stops serving."""
        self._live.add(generation)

    async def _run(self) -> None:
        while True:
            try:
                self._update(await self._read())
            except Exception:               # never stop watching (a bug here: logged once a poll)
                log.exception("backend health watch")
            await asyncio.sleep(self.interval_s)

    def _update(self, reason: str) -> None:
        was, self.reason = self.reason, reason
        if reason and not was:
            log.warning("the backend cannot serve: %s; failing its %d waiting requests", reason, len(self._live))
            for generation in list(self._live):
                generation.fail(self.error())
        elif was and not reason:
            log.info("the backend serves again")

    async def _read(self) -> str:
        """The supervisor's word: the cause while `backend_ready` is false, else "" (also
        when it cannot be reached or read). On a thread: off the event loop."""
        status, text = await asyncio.to_thread(http_request, self.url, timeout_s=self.timeout_s)
        try:
            body = json.loads(text) if status is not None else {}
        except ValueError:
            return ""
        if isinstance(body, dict) and body.get("backend_ready") is False:
            return str(body.get("backend_reason") or "not ready")
        return ""
