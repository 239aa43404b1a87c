"""The backend's own word on its health, in a file that a supervisor outside the process reads.

Why a file, and not Triton's API: Triton 24.10 answers `/v2/models/<m>/ready` without
asking the python-backend stub, so a stub that was killed, or that hangs with the GIL
held, still reads as ready there. The stub's heartbeat thread rewrites its report every
half second; the supervisor notices a report that goes stale, a process
that vanishes without having written `stopped`, or a report that says `unhealthy`.

Standard library only: the supervisor imports this module without torch or Triton.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

# Set by the supervisor on tritonserver's environment; without it nothing is written.
HEALTH_DIR_ENV = "PAGED_LLM_HEALTH_DIR"

SERVING, UNHEALTHY, STOPPED = "serving", "unhealthy", "stopped"
# Causes a report can name (kept few: they become a metric label).
ENGINE_FAILED, ENGINE_STALLED = "engine_failed", "engine_stalled"


@dataclass
class HealthReport:
    instance: str            # Triton's model instance name, e.g. "llm_0_0" (the stub's argv too)
    model: str
    pid: int
    state: str = SERVING     # serving | unhealthy | stopped
    kind: str = ""           # why unhealthy: engine_failed | engine_stalled
    cause: str = ""          # the same, in words
    stale_after_s: float = 60.0  # the supervisor treats an older heartbeat as a hung process
    # The model this one sends its requests to, if any (a TensorRT-LLM front's `llm`):
    # while that model has a dead process, this one's requests wait on streams that never
    # end, so a drain or a shutdown does not wait for it.
    calls: str = ""
    time: float = field(default_factory=time.time)  # wall clock of the last write


def report_path(directory: str, instance: str) -> str:
    return os.path.join(directory, f"{instance}.json")


def write_report(directory: str, report: HealthReport) -> None:
    """Atomic (write then rename): a reader never sees half a report."""
    report.time = time.time()
    path = report_path(directory, report.instance)
    tmp = f"{path}.{report.pid}.tmp"
    with open(tmp, "w") as f:
        json.dump(asdict(report), f)
    os.replace(tmp, path)


def read_reports(directory: str) -> dict[str, HealthReport]:
    reports: dict[str, HealthReport] = {}
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return reports
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                report = HealthReport(**json.load(f))
        except (OSError, ValueError, TypeError):
            continue  # removed meanwhile, or not ours
        reports[report.instance] = report
    return reports


class HealthReporter:
    """Stub side: one model instance's report, rewritten on every heartbeat."""

    def __init__(self, directory: str, instance: str, model: str, stale_after_s: float, calls: str = "") -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.report = HealthReport(instance=instance, model=model, pid=os.getpid(), stale_after_s=stale_after_s,
                                   calls=calls)
        # The heartbeat thread and the adapter's (unhealthy, stopped) write the same
        # temporary file: one at a time.
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, instance: str, model: str, stale_after_s: float, calls: str = "") -> Optional["HealthReporter"]:
        directory = os.environ.get(HEALTH_DIR_ENV)
        return cls(directory, instance, model, stale_after_s, calls) if directory else None

    def heartbeat(self) -> None:
        with self._lock:
            write_report(self.directory, self.report)

    def beat_until(self, stop: threading.Event, interval_s: float = 0.5) -> None:
        """The heartbeat thread's loop, until `stop` (set once the final report is
        written: a clean unload can take seconds after the adapter stops its other
        threads). A thread of its own: the watcher's calls into the server (readiness,
        metric pushes) can take seconds on a busy machine, and a heartbeat that waited
        for them would read as a hung process. A write that fails (the folder gone, a
        full disk) is said once on stderr and tried again at the next beat."""
        said = False
        while not stop.wait(interval_s):
            try:
                self.heartbeat()
                said = False
            except OSError as e:
                if not said:
                    print(f"[paged_llm] health report not written: {e}", file=sys.stderr, flush=True)
                    said = True

    def unhealthy(self, kind: str, cause: str) -> None:
        with self._lock:
            self.report.state, self.report.kind, self.report.cause = UNHEALTHY, kind, cause
        self.heartbeat()

    def stopped(self) -> None:
        """A clean exit. An unhealthy report keeps its cause: the supervisor acts on it."""
        with self._lock:
            if self.report.state != UNHEALTHY:
                self.report.state = STOPPED
        self.heartbeat()
