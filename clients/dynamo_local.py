"""A Dynamo deployment on this machine, in one command:

    python -m clients.dynamo_local --model-repository model_repository --workers 2 \\
        --router-mode kv --port 8080 --api-key KEY

starts NATS and etcd (Debian's `nats-server` and `etcd-server`), `--workers` of our Dynamo
workers (`python -m backend.dynamo_worker`) over one model repository entry, Dynamo's own
frontend (`python -m dynamo.frontend`) with the router mode asked for, and, with API keys,
our HTTP guard in front of it (Dynamo's frontend takes no key). Everything listens on
loopback except the port clients use, which `--host` places. Ctrl-C stops it all.

The tests and benchmarks start the same processes through `Stack`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Optional

from clients.tritonserver import free_port

ROUTER_MODES = ("kv", "round-robin", "random", "least-loaded", "power-of-two")


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
    """Child processes, each logging to `<root>/<name>.log`, stopped in reverse order."""
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

    def wait_for(self, ready: Callable[[], bool], what: str, timeout_s: float = 180.0) -> None:
        """Until `ready()`; a child that exits meanwhile fails it, with its log's end."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():
                return
            dead = [c for c in self.children if c.process.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited ({dead[0].process.returncode}) while waiting for "
                                   f"{what}:\n{dead[0].log()[-3000:]}")
            time.sleep(0.2)
        raise RuntimeError(f"{what}: not ready in {timeout_s:.0f} s")


def start_services(root: str, attempts: int = 3) -> Stack:
    """NATS (with JetStream) and etcd on loopback ports, and the environment Dynamo reads
    them from (NATS_SERVER, ETCD_ENDPOINTS). A free port can be taken by another process
    before the service binds it (CI's two lanes start servers side by side): then again
    on fresh ports, up to `attempts` times."""
    for attempt in range(attempts):
        stack = _start_services(root)
        try:
            stack.wait_for(lambda: "Server is ready" in stack.children[0].log(), "nats-server")
            # (ours alive: the port's answer could be another etcd's, ours having failed to bind)
            etcd = stack.children[1]
            stack.wait_for(lambda: etcd.process.poll() is None and http_ok(f"http://127.0.0.1:{etcd.port}/health"),
                           "etcd")
            return stack
        except RuntimeError as e:
            stack.stop_all()
            if "address already in use" not in str(e) or attempt + 1 == attempts:
                raise
            for folder in ("jetstream", "etcd"):
                shutil.rmtree(os.path.join(root, folder), ignore_errors=True)
    raise AssertionError("unreachable")


def _start_services(root: str) -> Stack:
    nats_port, etcd_port, peer_port = free_port(), free_port(), free_port()
    env = {**os.environ, "NATS_SERVER": f"nats://127.0.0.1:{nats_port}",
           "ETCD_ENDPOINTS": f"http://127.0.0.1:{etcd_port}", "PYTHONUNBUFFERED": "1"}
    stack = Stack(root, env)
    stack.start("nats", ["nats-server", "-a", "127.0.0.1", "-p", str(nats_port), "-js",
                         "-sd", os.path.join(root, "jetstream")], nats_port)
    stack.start("etcd", ["etcd", "--name", "local", "--data-dir", os.path.join(root, "etcd"),
                         "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                         "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                         "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                         "--initial-cluster", f"local=http://127.0.0.1:{peer_port}"], etcd_port)
    return stack


def start_worker(stack: Stack, name: str, repository: str, model: str = "llm", mode: str = "aggregated",
                 served_model_name: Optional[str] = None) -> Child:
    """Our Dynamo worker over the entry `model`, in the role `mode`, serving it as
    `served_model_name` (default: the entry's name)."""
    return stack.start(name, [sys.executable, "-m", "backend.dynamo_worker", "--model-repository", repository,
                              "--model", model, "--served-model-name", served_model_name or model,
                              "--event-plane", "nats", "--disaggregation-mode", mode])


def start_frontend(stack: Stack, name: str, router_mode: str, port: Optional[int] = None) -> Child:
    port = port or free_port()
    return stack.start(name, [sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
                              "--http-port", str(port), "--router-mode", router_mode,
                              "--discovery-backend", "etcd", "--event-plane", "nats"], port)


def start_guard(stack: Stack, upstream_port: int, api_keys: list[str], host: str = "127.0.0.1",
                port: Optional[int] = None) -> Child:
    port = port or free_port()
    argv = [sys.executable, "-m", "frontend.http_guard", "--listen", f"{host}:{port}",
            "--upstream", f"127.0.0.1:{upstream_port}", "--openai-only"]
    for key in api_keys:
        argv += ["--api-key", key]
    guard = stack.start("guard", argv, port)
    stack.wait_for(lambda: http_ok(f"http://127.0.0.1:{port}/health"), "the HTTP guard")
    return guard


def http_ok(url: str) -> bool:
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


def workers_seen(frontend: Child) -> int:
    """How many workers the frontend's KV router has added (it logs each)."""
    return len(set(re.findall(r"Adding worker WorkerWithDpRank \{ worker_id: (\d+)", frontend.log())))


def deploy(stack: Stack, repository: str, num_workers: int, frontend_ports: dict[str, Optional[int]],
           model: str = "llm") -> tuple[list[Child], dict[str, Child]]:
    """Workers, and one frontend per router mode (on the port given, or a free one), ready:
    each lists the model, and a KV router has seen every worker."""
    workers = [start_worker(stack, f"worker{i}", repository, model) for i in range(num_workers)]
    frontends = {mode: start_frontend(stack, f"frontend-{mode}", mode, port) for mode, port in frontend_ports.items()}
    for mode, frontend in frontends.items():
        stack.wait_for(lambda: models_listed(frontend.port, model), f"{frontend.name} lists {model}")
        if mode == "kv":
            stack.wait_for(lambda: workers_seen(frontend) >= num_workers, f"{frontend.name} sees every worker")
    return workers, frontends


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m clients.dynamo_local", description=__doc__.splitlines()[0])
    p.add_argument("--model-repository", default="model_repository")
    p.add_argument("--model", default="llm")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--router-mode", default="kv", choices=ROUTER_MODES)
    p.add_argument("--host", default="127.0.0.1", help="where clients reach the API (0.0.0.0 needs --api-key)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", action="append", default=[], help="keys for /v1/* (repeatable; also API_KEY)")
    args = p.parse_args(argv)
    keys = args.api_key + [k for k in os.environ.get("API_KEY", "").split(",") if k]
    if ":" in args.host:
        # (Dynamo's frontend is started on 127.0.0.1, and the guard is waited for there.)
        p.error(f"--host {args.host}: clients.dynamo_local listens on IPv4 only; use 127.0.0.1, or 0.0.0.0 "
                "with --api-key")
    if args.host not in ("127.0.0.1", "localhost") and not keys:
        p.error(f"--host {args.host} exposes the API: give it --api-key (or API_KEY)")
    root = tempfile.mkdtemp(prefix="dynamo-local-")
    stack = start_services(root)
    try:
        # With keys, the frontend stays on a loopback port and the guard takes the clients' port.
        _, frontends = deploy(stack, os.path.abspath(args.model_repository), args.workers,
                              {args.router_mode: None if keys else args.port}, args.model)
        if keys:
            start_guard(stack, frontends[args.router_mode].port, keys, args.host, args.port)
        print(f"serving '{args.model}' at http://{args.host}:{args.port}/v1 ({args.workers} workers, "
              f"router {args.router_mode}); logs in {root}", flush=True)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})   # (children started)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        stack.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
