"""Real processes for the Dynamo tests: NATS and etcd from Debian's packages
(`nats-server`, `etcd-server`), our Dynamo workers, Dynamo's own frontend and our HTTP
guard, each on loopback ports of its own, with its log in a file."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest

from clients.tritonserver import free_port

SERVICES = ("nats-server", "etcd")


def require_services() -> None:
    """Skip where NATS or etcd is not installed, except in CI (.ci/run installs them)."""
    missing = [name for name in SERVICES if shutil.which(name) is None]
    try:
        import dynamo.llm  # noqa: F401
    except ImportError:
        missing.append("ai-dynamo (pip install --no-deps -r requirements/dynamo.txt)")
    if missing:
        message = f"not installed: {', '.join(missing)} (make dynamo installs them)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log_path: str
    port: Optional[int] = None

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, timeout_s: float = 30.0) -> Optional[int]:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


@dataclass
class Stack:
    root: str
    env: dict[str, str]
    children: list[Child] = field(default_factory=list)

    def start(self, name: str, argv: list[str], port: Optional[int] = None) -> Child:
        log_path = os.path.join(self.root, f"{name}.log")
        with open(log_path, "w") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.root)
        child = Child(name, process, log_path, port)
        self.children.append(child)
        return child

    def stop_all(self) -> None:
        for child in reversed(self.children):
            child.stop()


def start_services(root: str) -> Stack:
    """NATS (with JetStream) and etcd on loopback, and the environment Dynamo reads them from."""
    nats_port, etcd_port, peer_port = free_port(), free_port(), free_port()
    env = {**os.environ, "NATS_SERVER": f"nats://127.0.0.1:{nats_port}",
           "ETCD_ENDPOINTS": f"http://127.0.0.1:{etcd_port}", "PYTHONUNBUFFERED": "1"}
    stack = Stack(root, env)
    stack.start("nats", ["nats-server", "-a", "127.0.0.1", "-p", str(nats_port), "-js",
                         "-sd", os.path.join(root, "jetstream")], nats_port)
    stack.start("etcd", ["etcd", "--name", "test", "--data-dir", os.path.join(root, "etcd"),
                         "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                         "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                         "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                         "--initial-cluster", f"test=http://127.0.0.1:{peer_port}"], etcd_port)
    wait_for(lambda: "Server is ready" in stack.children[0].log(), "nats-server", stack)
    wait_for(lambda: _http_ok(f"http://127.0.0.1:{etcd_port}/health"), "etcd", stack)
    return stack


def start_worker(stack: Stack, name: str, repository: str) -> Child:
    return stack.start(name, [sys.executable, "-m", "backend.dynamo_worker", "--model-repository", repository,
                              "--event-plane", "nats"])


def start_frontend(stack: Stack, name: str, router_mode: str) -> Child:
    port = free_port()
    return stack.start(name, [sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
                              "--http-port", str(port), "--router-mode", router_mode,
                              "--discovery-backend", "etcd", "--event-plane", "nats"], port)


def start_guard(stack: Stack, upstream_port: int, api_key: str) -> Child:
    port = free_port()
    return stack.start("guard", [sys.executable, "-m", "frontend.http_guard", "--listen", f"127.0.0.1:{port}",
                                 "--upstream", f"127.0.0.1:{upstream_port}", "--api-key", api_key], port)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


def models_listed(port: int, name: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
            return f'"{name}"' in r.read().decode()
    except Exception:
        return False


def wait_for(ready: Callable[[], bool], what: str, stack: Stack, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        dead = [c for c in stack.children if c.process.poll() is not None]
        if dead:
            raise AssertionError(f"{dead[0].name} exited ({dead[0].process.returncode}) while waiting for "
                                 f"{what}:\n{dead[0].log()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"{what} not ready in {timeout_s} s")


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus series' samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        series, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total
