"""Linux process facts the supervisor needs: is a backend process alive, which are a
server's python-backend stubs, and the shared memory they leave behind when killed."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Optional

STUB_BINARY = "triton_python_backend_stub"


@dataclass(frozen=True)
class Stub:
    pid: int
    instance: str    # Triton's model instance name, e.g. "llm_0_0"
    shm_region: str  # the stub's shared-memory region under /dev/shm
    model_path: str  # the model.py it runs (inside the model repository)


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _stat(pid: int) -> tuple[str, int]:
    """(state letter, parent pid); ("", 0) when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return rest[0], int(rest[1])
    except (OSError, IndexError, ValueError):
        return "", 0


def alive(pid: int, instance: str = "") -> bool:
    """Running (not a zombie) and, when `instance` is given, still that stub: pids are reused."""
    state, _ = _stat(pid)
    if state in ("", "Z", "X"):
        return False
    return not instance or instance in _cmdline(pid)


def start_ticks(pid: int) -> int:
    """When the process started, in clock ticks since boot (/proc/PID/stat field 22); 0
    when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def now_ticks() -> int:
    """Clock ticks since boot now, on the scale of start_ticks."""
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))


def _pid_namespace(pid: str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return ""


def stubs_of(server_pid: Optional[int] = None, lifetime: Optional[tuple[int, Optional[int]]] = None) -> list[Stub]:
    """Python-backend stub processes: the server's, or every one with no pid. Their argv is
    stub, model.py, shm region, shm sizes..., parent pid, backend dir, ipc handle, instance name, ...

    A server's stubs include those it left behind when it died: reparented, they still
    name it in their argv. One whose thread was inside a call to the server when the
    server died waits for the answer for ever, holding the GIL, so it never exits (seen
    with a server that failed to bind a port after loading its models).

    `lifetime`: the server's (start, end or None while it lives), in clock ticks since
    boot (start_ticks, now_ticks): a stub started outside it belongs to another process
    that got the same pid later. Stubs in another pid namespace (a container's, whose
    argv names a pid of its own namespace) are never a server's here."""
    found = []
    own_namespace = _pid_namespace("self") if server_pid is not None else ""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        child = server_pid is None or _stat(pid)[1] == server_pid
        if not child and _comm(pid) != STUB_BINARY[:15]:
            continue
        argv = _cmdline(pid)
        if not (argv and argv[0].endswith(STUB_BINARY) and len(argv) > 8):
            continue
        if not (child or argv[5] == str(server_pid)):
            continue
        if server_pid is not None:
            if own_namespace and _pid_namespace(entry) not in ("", own_namespace):
                continue
            if lifetime is not None:
                started = start_ticks(pid)
                if started < lifetime[0] or (lifetime[1] is not None and started > lifetime[1]):
                    continue
        found.append(Stub(pid=pid, instance=argv[8], shm_region=argv[2], model_path=argv[1]))
    return found


def _comm(pid: int) -> str:
    """The kernel's name of the process (15 characters at most): cheaper than its argv."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def end_stub(stub: Stub) -> None:
    """A stub that outlived its server: killed if it still runs (it holds memory, and the
    GPU), and its shared-memory region, which nobody else will unlink, removed."""
    if alive(stub.pid, stub.instance):
        kill(stub.pid)
    remove_shm(stub.shm_region)


def remove_shm(region: str) -> None:
    """A killed server cannot unlink its stubs' regions (1 MiB and more each)."""
    if "/" in region or not region:
        return
    try:
        os.unlink(os.path.join("/dev/shm", region))
    except FileNotFoundError:
        pass
