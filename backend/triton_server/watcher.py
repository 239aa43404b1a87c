"""The adapter's watcher thread: server-shutdown detection and the drain, metric pushes,
and the deep health check with what follows when it fails. (The supervisor's heartbeat
has a thread of its own: health_report.HealthReporter.beat_until.)

A mixin of TritonPythonModel (model.py), which owns the state it reads: the engine loop,
settings, metrics, the in-flight requests and the response queue.
"""

from __future__ import annotations

import sys
import threading
import time

import triton_python_backend_utils as pb_utils

from backend.engine.engine_loop import error_output
from backend.engine.errors import EngineDeadError
from backend.triton_server.health_report import ENGINE_FAILED, ENGINE_STALLED
from backend.triton_server.readiness import readiness_probe


def log_local(message: str) -> None:
    """Log without calling into the server. Once it is stopping, a stub-to-server call
    (pb_utils.Logger included) can block, and one still in flight when the server
    finalizes the model aborts the server (boost lock_exception). The stub's stderr
    goes to the server's log."""
    print(message, file=sys.stderr, flush=True)


class Watcher:
    _readiness = None       # the readiness probe (readiness.py), made on first use
    def _watch_loop(self) -> None:
        next_metrics = 0.0
        while not self._stopping.wait(0.1):
            if self._draining:
                continue
            if self._server_stopping():
                self._draining = True
                threading.Thread(target=self._drain, name="drain", daemon=True).start()
                continue
            # Metrics are calls into the server, which can block for good (holding the
            # GIL) if the server starts stopping meanwhile: make them only right after a
            # readiness answer, at most every 0.5 s, and only for values that changed.
            if self.metrics and time.monotonic() >= next_metrics:
                self.metrics.update()
                next_metrics = time.monotonic() + 0.5
            if not self._unhealthy and not self.is_healthy():
                self._unhealthy = True
                self._on_unhealthy()

    def _server_stopping(self) -> bool:
        """Triton keeps a model loaded while any decoupled stream is open, so finalize()
        comes only after every stream has ended. Shutdown is therefore detected here:
        once the model has been ready, readiness turning false, or the readiness call
        failing or hanging three times in a row (what it does while the server stops),
        means the server is stopping. Asked over HTTP where the launcher gave the
        server's address (readiness.py: the IPC call can crash the stub at SIGTERM)."""
        result: list = []
        if self._readiness is None:
            self._readiness = readiness_probe(self.model_name, pb_utils.is_model_ready)
        probe_ready = self._readiness

        def ask() -> None:
            try:
                result.append(probe_ready())
            except Exception as e:
                result.append(e)

        probe = threading.Thread(target=ask, daemon=True)
        probe.start()
        probe.join(timeout=1.0)
        answer = result[0] if result else TimeoutError("no answer within 1 s")
        if answer is True:
            self._seen_ready, self._readiness_failures = True, 0
            return False
        if not self._seen_ready:
            return False
        if answer is False or "not ready" in str(answer).lower():
            return True
        self._readiness_failures += 1
        return self._readiness_failures >= 3

    def _drain(self) -> None:
        log_local(f"[paged_llm] stopping: {self.loop.num_in_flight} requests in flight, "
                   f"grace period {self.settings.grace_period_s}s")
        self.loop.stop(self.settings.grace_period_s)
        log_local("[paged_llm] drained")

    def _on_unhealthy(self) -> None:
        """Fail what is in flight with a clear error and take the model out of service:
        unloading it makes Triton report it NOT READY (needs explicit model control)."""
        if self.loop.error is not None:
            kind, cause = ENGINE_FAILED, f"the engine loop failed: {self.loop.error!r}"
        else:
            kind, cause = ENGINE_STALLED, (f"requests were waiting and no engine step completed for "
                                           f"{self.settings.engine_stall_timeout_s}s")
        self.logger.log_error(f"[paged_llm] unhealthy: {cause}; unloading model '{self.model_name}'")
        if self.health:
            self.health.unhealthy(kind, cause)
        error = EngineDeadError(f"{cause}; the model is being unloaded")
        with self._inflight_lock:
            writers = [w for _, w in self._inflight.values()]
        for writer in writers:  # a dead loop already failed them; a stalled one cannot
            self._responses.put((writer, 0, error_output(writer.request_id, error)))
        threading.Thread(target=self._unload_self, daemon=True).start()

    def _unload_self(self) -> None:
        try:
            pb_utils.unload_model(self.model_name)
        except Exception as e:
            self.logger.log_error(f"[paged_llm] could not unload '{self.model_name}' ({e}); start tritonserver "
                                  "with --model-control-mode=explicit so an unhealthy model leaves service")

    # ---------------------------------------------------------------- health
    def is_healthy(self) -> bool:
        """Deep check: the loop thread is alive and, when it has work, keeps stepping."""
        if not self.loop.is_alive:
            return False
        busy = self.loop.num_in_flight > 0
        return not busy or time.monotonic() - self.loop.last_heartbeat < self.settings.engine_stall_timeout_s
