"""Install and run a real Triton Inference Server 2.51 on a machine without NVIDIA's image.

The server binary, its python backend and the python-backend stubs come from the
`nvidia-pytriton` 0.7.0 wheel (Triton 2.51.0, the 24.10 release), unpacked into
third_party/ without installing PyTriton's Python package or its dependencies.

    python -m clients.tritonserver install
    python -m clients.tritonserver serve --model-repository model_repository

`serve` runs tritonserver in the foreground under the supervisor (supervisor/): it
detects a dead or stalled backend process, recovers, and serves health and failure
metrics on `--supervisor-port` (Ctrl-C or SIGTERM stops both). `--no-supervisor` execs
tritonserver alone. `TritonServer` starts one in the background for tests and benchmarks.

Every server started here listens on `--host` (loopback unless asked) and restricts
Triton's repository API, and by default its shared-memory, logging, trace and model-config
groups, to the admin key (supervisor/admin_access.py, docs/security.md). Off loopback,
Triton's HTTP port is served by the validating guard (frontend/http_guard.py), with
tritonserver's own HTTP server on a loopback port behind it (`--http-guard`).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from typing import Optional

# (the variable that tells our backend where tritonserver's HTTP port is)
from backend.triton_server.readiness import SERVER_HTTP_ENV
from supervisor import processes
from supervisor.admin_access import HEADER, KEY_ENV, KEY_FILE_ENV, UNRESTRICTED_ENV, AdminAccess, AdminKeyError, resolve
from supervisor.triton_api import TritonAPI, http_request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIRD_PARTY = os.path.join(ROOT, "third_party")
WHEEL_SPEC = "nvidia-pytriton==0.7.0"
UNPACKED = os.path.join(THIRD_PARTY, "pytriton")
BACKENDS = os.path.join(THIRD_PARTY, "backends")
EXTRA_LIBS = os.path.join(THIRD_PARTY, "lib")
# Our Python-based backend: <backend-directory>/<name>/model.py, as Triton's vLLM backend.
BACKEND_NAME = "paged_llm"
BACKEND_SOURCE = os.path.join(ROOT, "backend", "triton_server")


def server_binary() -> str:
    return os.path.join(UNPACKED, "pytriton", "tritonserver", "bin", "tritonserver")


def _stub_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def install(force: bool = False) -> None:
    """Idempotent: unpack the wheel and lay out the backends directory."""
    if force and os.path.isdir(THIRD_PARTY):
        shutil.rmtree(THIRD_PARTY)
    if not os.path.isfile(server_binary()):
        wheels = os.path.join(THIRD_PARTY, "wheels")
        os.makedirs(wheels, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", wheels, WHEEL_SPEC],
                       check=True)
        wheel = glob.glob(os.path.join(wheels, "nvidia_pytriton-*.whl"))[0]
        with zipfile.ZipFile(wheel) as z:
            z.extractall(UNPACKED)
        os.chmod(server_binary(), 0o755)
        os.remove(wheel)

    tree = os.path.join(UNPACKED, "pytriton", "tritonserver")
    python_dir = os.path.join(BACKENDS, "python")
    os.makedirs(python_dir, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        _copy(os.path.join(tree, "backends", "python", name), os.path.join(python_dir, name))
    stub = os.path.join(tree, "python_backend_stubs", _stub_version(), "triton_python_backend_stub")
    if not os.path.isfile(stub):
        raise SystemExit(f"the wheel has no python-backend stub for Python {_stub_version()}")
    _copy(stub, os.path.join(python_dir, "triton_python_backend_stub"))
    os.chmod(os.path.join(python_dir, "triton_python_backend_stub"), 0o755)

    link = os.path.join(BACKENDS, BACKEND_NAME)
    if not os.path.islink(link):
        if os.path.exists(link):
            shutil.rmtree(link)
        os.symlink(BACKEND_SOURCE, link)

    # perf_analyzer (tritonclient 2.51 wheel) wants these two under their plain names.
    os.makedirs(EXTRA_LIBS, exist_ok=True)
    libs = os.path.join(UNPACKED, "nvidia_pytriton.libs")
    for plain, pattern in (("libb64.so.0d", "libb64-*.so.0d"), ("libcudart.so.12", "libcudart-*.so.12*")):
        found = glob.glob(os.path.join(libs, pattern))
        target = os.path.join(EXTRA_LIBS, plain)
        if found and not os.path.lexists(target):
            os.symlink(found[0], target)


def _copy(src: str, dst: str) -> None:
    if not os.path.isfile(dst) or os.path.getmtime(dst) < os.path.getmtime(src):
        shutil.copy2(src, dst)


def server_env() -> dict[str, str]:
    """The python-backend stub must load the same libpython as this interpreter and see
    this virtual environment's packages."""
    env = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    paths = [libdir, os.path.join(UNPACKED, "nvidia_pytriton.libs"), EXTRA_LIBS]
    env["LD_LIBRARY_PATH"] = ":".join(p for p in paths + [env.get("LD_LIBRARY_PATH", "")] if p)
    venv_bin = os.path.dirname(sys.executable)
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    if sys.prefix != sys.base_prefix:
        env["VIRTUAL_ENV"] = sys.prefix
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def server_command(model_repository: str, http_port: int, grpc_port: int, metrics_port: int,
                   admin: AdminAccess, extra: Optional[list[str]] = None, binary: Optional[str] = None,
                   backend_directory: Optional[str] = None, host: str = "127.0.0.1",
                   http_host: Optional[str] = None) -> list[str]:
    """`http_host`: where Triton's HTTP port listens, when not `host` (behind the guard)."""
    return [binary or server_binary(), "--model-repository", os.path.abspath(model_repository),
            "--backend-directory", backend_directory or BACKENDS,
            "--http-address", _evhtp_address(http_host or host), "--grpc-address", _grpc_address(host),
            "--metrics-address", _evhtp_address(host),
            "--http-port", str(http_port), "--grpc-port", str(grpc_port),
            "--metrics-port", str(metrics_port), "--allow-metrics", "true", "--allow-gpu-metrics", "false",
            # Explicit control, everything loaded at start: lets an unhealthy model unload
            # itself so that its readiness turns false. Its repository API (load, unload,
            # load with files) takes the admin key.
            "--model-control-mode", "explicit", "--load-model", "*", *admin.server_args(),
            *(extra or [])]


def _is_ipv6(host: str) -> bool:
    return ":" in host


def _evhtp_address(host: str) -> str:
    """Triton's HTTP and metrics servers (libevhtp) read an IPv6 address as `ipv6:ADDR`;
    a bare `::1` is taken for IPv4 and the bind fails."""
    return f"ipv6:{host.strip('[]')}" if _is_ipv6(host) else host


def _grpc_address(host: str) -> str:
    """Triton's gRPC server listens on `ADDRESS:PORT`: an IPv6 address goes in brackets."""
    return f"[{host.strip('[]')}]" if _is_ipv6(host) else host


def frontend_tls_args(triton_args: list[str]) -> list[str]:
    """When tritonserver's gRPC serves TLS (`--grpc-use-ssl=true`), the OpenAI frontend
    beside it must too: it trusts `--grpc-root-cert`, else the (self-signed) server
    certificate, unless TRITON_GRPC_ROOT_CERT names one. Mutual TLS is not supported."""
    given: dict[str, str] = {}
    rest = iter(triton_args)
    for arg in rest:
        if arg.startswith("--grpc-"):
            name, eq, value = arg.partition("=")
            given[name] = value if eq else next(rest, "")
    if given.get("--grpc-use-ssl", "").lower() not in ("true", "1", "on", "yes") or \
            os.environ.get("TRITON_GRPC_ROOT_CERT"):
        return []
    root = given.get("--grpc-root-cert") or given.get("--grpc-server-cert")
    return ["--triton-ssl-root-cert", root] if root else []


def local_address(host: str) -> str:
    """Where a process on this machine reaches a server bound to `host`, written as a URL's
    or a gRPC target's host: an IPv6 literal in brackets (`http://[::1]:8000`). A server
    bound to every IPv6 address is reached on ::1 (it may not take IPv4: bindv6only)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        host = "::1"
    return f"[{host}]" if _is_ipv6(host) and not host.startswith("[") else host


def exposure_warnings(host: str, no_supervisor: bool, wants_guard: bool) -> list[str]:
    """What `serve` warns about before it starts, off loopback: Triton's inference APIs
    take no key (the OpenAI API's key does not cover them), and without the supervisor
    no HTTP guard stands in front of Triton's HTTP port."""
    out = []
    if not is_loopback(host):
        out.append(f"warning: --host {host} exposes Triton's inference APIs (HTTP and gRPC), which take no key: "
                   "anyone who reaches them can run requests (docs/security.md)")
    if no_supervisor and wants_guard:
        out.append("warning: --no-supervisor runs no HTTP guard: Triton 24.10's HTTP port is exposed to "
                   "CVE-2025-23310/23311")
    return out


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def guard_enabled(mode: str, host: str) -> bool:
    """`--http-guard`: on, off, or auto (on wherever Triton's HTTP port is not on loopback)."""
    return mode == "on" or (mode == "auto" and not is_loopback(host))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TritonServer:
    """A tritonserver child process on free loopback ports; a context manager. With
    `supervised=True` it is started as `make serve` does, under the supervisor."""

    def __init__(self, model_repository: str, log_path: Optional[str] = None,
                 extra_args: Optional[list[str]] = None, startup_timeout_s: float = 180.0,
                 supervised: bool = False, openai: bool = False, unrestricted_apis: tuple[str, ...] = (),
                 api_keys: tuple[str, ...] = ()) -> None:
        """openai: with supervised, also the OpenAI-compatible frontend (as `make serve`),
        which checks `api_keys` when given. A fresh admin key is made for each server
        (`admin_headers`); `unrestricted_apis` opens optional groups, as `--unrestricted-api`."""
        install()
        self.admin = resolve(unrestricted=list(unrestricted_apis), environ={})
        self.api_keys = tuple(api_keys)
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        self.supervised = supervised
        self.openai_port = free_port() if supervised and openai else 0
        self.supervisor_port = free_port() if supervised else None
        self.model_repository = model_repository
        if log_path is None:
            os.makedirs(os.path.join(THIRD_PARTY, "logs"), exist_ok=True)
            log_path = os.path.join(THIRD_PARTY, "logs", f"tritonserver-{self.http_port}.log")
        self.log_path = log_path
        self.extra_args = extra_args
        # The last --allow-metrics given wins, as in Triton's own parsing.
        args = " ".join(extra_args or []).replace("--allow-metrics ", "--allow-metrics=").split()
        allow = [a.split("=", 1)[1] for a in args if a.startswith("--allow-metrics=")]
        self.metrics_enabled = not allow or allow[-1].lower() not in ("false", "0", "off", "no")
        self.startup_timeout_s = startup_timeout_s
        self.proc: Optional[subprocess.Popen] = None

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def openai_url(self) -> str:
        return f"http://127.0.0.1:{self.openai_port}"

    @property
    def supervisor_url(self) -> str:
        return f"http://127.0.0.1:{self.supervisor_port}"

    @property
    def admin_headers(self) -> dict[str, str]:
        """What an HTTP call to a restricted API group must carry."""
        return self.admin.headers()

    @property
    def admin_grpc_headers(self) -> dict[str, str]:
        """What a gRPC call to a restricted API group must carry."""
        return self.admin.grpc_headers()

    def command(self) -> list[str]:
        if not self.supervised:
            return server_command(self.model_repository, self.http_port, self.grpc_port, self.metrics_port,
                                  self.admin, self.extra_args)
        return [sys.executable, "-m", "clients.tritonserver", "serve", "--model-repository", self.model_repository,
                "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
                "--metrics-port", str(self.metrics_port), "--supervisor-port", str(self.supervisor_port),
                "--openai-port", str(self.openai_port),
                *(a for g in self.admin.unrestricted for a in ("--unrestricted-api", g)), *(self.extra_args or [])]

    def start(self) -> "TritonServer":
        self._log = open(self.log_path, "w")
        # Keys travel in the environment, not on a command line others can read.
        env = {k: v for k, v in server_env().items()
               if k not in (KEY_FILE_ENV, UNRESTRICTED_ENV, "API_KEY", "API_KEY_FILE")}
        env.update(self.admin.env())
        if not self.supervised:             # (`serve` sets its own)
            env[SERVER_HTTP_ENV] = f"127.0.0.1:{self.http_port}"
        if self.api_keys:
            env["API_KEY"] = ",".join(self.api_keys)
        self.proc = subprocess.Popen(self.command(), env=env, cwd=ROOT, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        self._started_ticks = processes.start_ticks(self.proc.pid)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.proc.returncode}:\n{self.log_tail()}")
            # Triton opens its metrics port after the HTTP one: wait for both, or a caller
            # that reads metrics right after start() can find the port still closed.
            if self.is_ready() and (not self.metrics_enabled or self._metrics_up()):
                return self
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"tritonserver not ready after {self.startup_timeout_s}s:\n{self.log_tail()}")

    def is_ready(self) -> bool:
        return TritonAPI(self.http_url).server_ready()

    def _metrics_up(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.metrics_port), timeout=1):
                return True
        except OSError:
            return False

    def model_ready(self, model: str) -> bool:
        return TritonAPI(self.http_url).model_ready(model)

    def supervisor(self, path: str = "/status") -> tuple[int, str]:
        """(HTTP status, body) of one of the supervisor's endpoints; (0, error) if unreachable."""
        status, body = http_request(self.supervisor_url + path)
        return status or 0, body

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
            return r.read().decode()

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 60.0) -> Optional[int]:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.supervised:
            # A killed server leaves its stubs behind, some for good (one blocked in a call
            # to it holds the GIL: supervisor/processes.py); the supervisor cleans its own.
            for stub in processes.stubs_of(self.proc.pid, (self._started_ticks, processes.now_ticks())):
                processes.end_stub(stub)
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "TritonServer":
        if self.proc is not None and self.proc.poll() is None:
            return self  # already started
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def sidecars(args: argparse.Namespace, triton_args: list[str], admin: AdminAccess, triton_http_port: int,
             guarded: bool) -> list:
    """The processes the supervisor keeps beside tritonserver: the OpenAI API (it waits for
    tritonserver on its own; its /health says so) and the HTTP guard. Keys reach them in
    their environment: a command line is readable by every user."""
    from supervisor.sidecars import Sidecar
    out = []
    if guarded:
        out.append(Sidecar("http-guard", [sys.executable, "-m", "frontend.http_guard",
                                          "--listen", f"{args.host}:{args.http_port}",
                                          "--upstream", f"127.0.0.1:{triton_http_port}"], env=dict(os.environ),
                           ready_url=f"http://{local_address(args.host)}:{args.http_port}/v2/health/ready"))
    if args.openai_port:
        tls = [a for flag, v in (("--ssl-certfile", args.ssl_certfile), ("--ssl-keyfile", args.ssl_keyfile)) if v
               for a in (flag, v)]
        out.append(Sidecar("openai", [sys.executable, "-m", "frontend.openai_api", "--host", args.host,
                                      "--port", str(args.openai_port),
                                      "--triton-url", f"{local_address(args.host)}:{args.grpc_port}",
                                      "--model-repository", args.model_repository, *tls,
                                      # (fail fast while the backend cannot serve: backend_health.py)
                                      "--backend-health-url",
                                      f"http://{local_address(args.host)}:{args.supervisor_port}/ready?scope=backend",
                                      *frontend_tls_args(triton_args),
                                      *(["--enable-log-requests"] if args.enable_log_requests else []),
                                      *(["--enable-auto-tool-choice"] if args.enable_auto_tool_choice else []),
                                      *(a for flag, v in (("--tool-call-parser", args.tool_call_parser),
                                                          ("--reasoning-parser", args.reasoning_parser)) if v
                                        for a in (flag, v))],
                           env={**os.environ, **admin.env()},
                           # Over TLS the certificate may be one no client here trusts: running is enough.
                           ready_url="" if tls else f"http://{local_address(args.host)}:{args.openai_port}/health"))
    return out


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m clients.tritonserver", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("install", help="unpack Triton Inference Server 2.51 into third_party/")
    i.add_argument("--force", action="store_true")
    s = sub.add_parser("serve", help="run tritonserver in the foreground")
    s.add_argument("--model-repository", default="model_repository")
    s.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"),
                   help="the address every port listens on (tritonserver's, the supervisor's, the OpenAI API's); "
                        "default 127.0.0.1 (HOST): 0.0.0.0 exposes them to the network")
    s.add_argument("--http-port", type=int, default=int(os.environ.get("HTTP_PORT", 8000)))
    s.add_argument("--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", 8001)))
    s.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", 8002)))
    s.add_argument("--supervisor-port", type=int, default=int(os.environ.get("SUPERVISOR_PORT", 8003)),
                   help="the supervisor's /live, /ready, /status and /metrics (read-only)")
    s.add_argument("--openai-port", type=int, default=int(os.environ.get("OPENAI_PORT", 9000)),
                   help="the OpenAI-compatible API (python -m frontend.openai_api) beside tritonserver; 0: none")
    s.add_argument("--admin-key-file", help="a file holding the key of Triton's restricted API groups "
                   "(else TRITON_ADMIN_KEY, TRITON_ADMIN_KEY_FILE, or one generated at start)")
    s.add_argument("--unrestricted-api", action="append", default=None, metavar="GROUP",
                   help="open one of shared-memory, logging, trace, model-config to clients without the admin key "
                        "(repeatable; TRITON_UNRESTRICTED_APIS, comma-separated); model-repository stays restricted")
    s.add_argument("--enable-log-requests", action="store_true",
                   help="the OpenAI API logs prompts, parameters and outputs (off by default)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="the OpenAI API's tool_choice 'auto', read by --tool-call-parser (vLLM's flags)")
    s.add_argument("--tool-call-parser", help="hermes, llama3_json, mistral or pythonic")
    s.add_argument("--reasoning-parser", help="deepseek_r1 or qwen3: <think> blocks become reasoning_content")
    s.add_argument("--ssl-certfile", help="TLS certificate of the OpenAI API (uvicorn's)")
    s.add_argument("--ssl-keyfile", help="TLS private key of the OpenAI API (uvicorn's)")
    s.add_argument("--http-guard", choices=("auto", "on", "off"), default=os.environ.get("HTTP_GUARD", "auto"),
                   help="serve Triton's HTTP port through the validating guard (frontend/http_guard.py), "
                        "tritonserver's own HTTP server on a loopback port behind it; auto (HTTP_GUARD): on "
                        "unless --host is loopback. Triton 24.10's HTTP server crashes on some bodies "
                        "(CVE-2025-23310/23311)")
    s.add_argument("--no-supervisor", action="store_true",
                   help="exec tritonserver alone, unwatched (no OpenAI API, no HTTP guard)")
    s.add_argument("--max-recovery-tries", type=int, default=3)
    s.add_argument("--tritonserver", default=os.environ.get("TRITONSERVER"),
                   help="a tritonserver binary to use instead of the unpacked wheel's (e.g. in NVIDIA's image)")
    s.add_argument("--backend-directory", default=os.environ.get("TRITON_BACKEND_DIRECTORY"))
    args, extra = ap.parse_known_args(argv)
    if getattr(args, "host", None):
        args.host = args.host.strip("[]")     # (`--host [::1]`: the address itself from here on)
    if args.cmd == "install":
        install(force=args.force)
        print(f"tritonserver: {server_binary()}\nbackends:     {BACKENDS}")
        return
    if args.tritonserver is None:
        install()
    try:
        admin = resolve(key_file=args.admin_key_file, unrestricted=args.unrestricted_api,
                        write_generated=True)
    except AdminKeyError as e:
        raise SystemExit(f"serve: {e}") from None
    wants_guard = guard_enabled(args.http_guard, args.host)
    guarded = wants_guard and not args.no_supervisor        # the supervisor runs the guard
    triton_http_port = free_port() if guarded else args.http_port
    cmd = server_command(args.model_repository, triton_http_port, args.grpc_port, args.metrics_port, admin, extra,
                         binary=args.tritonserver, backend_directory=args.backend_directory, host=args.host,
                         http_host="127.0.0.1" if guarded else None)
    env = server_env() if args.tritonserver is None else dict(os.environ)
    # Where our backend asks whether its model is still ready (backend/triton_server/readiness.py).
    env[SERVER_HTTP_ENV] = f"{'127.0.0.1' if guarded else local_address(args.host)}:{triton_http_port}"
    for name in ("API_KEY", "API_KEY_FILE", KEY_ENV, KEY_FILE_ENV):   # the frontend's, and ours
        env.pop(name, None)
    # The model's stub checks runtime LoRA changes against it (backend/triton_server/engine_control.py).
    env[KEY_ENV] = admin.key
    print(" ".join(admin.redact(cmd)), flush=True)
    where = f"generated, in {admin.key_file}" if admin.generated else "given"
    print(f"Triton's {', '.join(admin.restricted)} APIs take the header '{HEADER}' (key {where})", flush=True)
    for warning in exposure_warnings(args.host, args.no_supervisor, wants_guard):
        print(warning, file=sys.stderr, flush=True)
    if args.no_supervisor:
        os.execve(cmd[0], cmd, env)
    import logging

    from supervisor.core import Supervisor, SupervisorOptions
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [supervisor] %(levelname)s %(message)s",
                        stream=sys.stderr)
    try:
        code = Supervisor(SupervisorOptions(command=cmd, env=env, http_port=triton_http_port,
                                            port=args.supervisor_port, host=args.host,
                                            triton_host="127.0.0.1" if guarded else local_address(args.host),
                                            admin_headers=admin.headers(), max_tries=args.max_recovery_tries,
                                            sidecars=sidecars(args, extra, admin, triton_http_port, guarded))).run()
    finally:
        if admin.generated and admin.key_file:
            shutil.rmtree(os.path.dirname(admin.key_file), ignore_errors=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
