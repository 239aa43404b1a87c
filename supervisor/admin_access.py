"""Who may change what tritonserver runs: Triton's restricted API groups and their key.

We run Triton in explicit model-control mode (the supervisor unloads and reloads a failed
model). Left open, its repository API lets anyone who reaches the HTTP or gRPC port unload
the model, or load a model whose request carries `file:` overrides: Python that the
server then runs. Triton's own `--http-restricted-api` and `--grpc-restricted-protocol`
close that: a call to a restricted group must carry the header `admin-key: <key>`, or
Triton refuses it and changes nothing.

`model-repository` is always restricted. `shared-memory`, `logging`, `trace` and
`model-config` are too, unless a deployment opts out (`--unrestricted-api GROUP`):
perf_analyzer and genai-perf read the model config over gRPC, where perf_analyzer cannot
send headers (its `-H` is HTTP-only). Inference, health, metadata and statistics stay open.

The key comes from `TRITON_ADMIN_KEY`, or the file `TRITON_ADMIN_KEY_FILE` names; with
neither, the launcher generates one and writes it to a file only its user can read.
Standard library only: the supervisor imports this.
"""

from __future__ import annotations

import os
import re
import secrets
import tempfile
from dataclasses import dataclass
from typing import Optional

HEADER = "admin-key"
GRPC_PREFIX = "triton-grpc-protocol-"
KEY_ENV, KEY_FILE_ENV, UNRESTRICTED_ENV = "TRITON_ADMIN_KEY", "TRITON_ADMIN_KEY_FILE", "TRITON_UNRESTRICTED_APIS"
ALWAYS = ("model-repository",)
OPTIONAL = ("shared-memory", "logging", "trace", "model-config")
# Triton parses `<groups>:<header>=<value>`: a key may not hold ':', '=', ',' or spaces.
_KEY = re.compile(r"[A-Za-z0-9._~+/-]{16,512}")


class AdminKeyError(ValueError):
    """A bad key or group; the message names the setting."""


def check_key(key: str, source: str) -> str:
    key = key.strip()
    if not _KEY.fullmatch(key):
        raise AdminKeyError(f"{source}: the admin key must be 16 to 512 characters of letters, digits and "
                            "'._~+/-' (Triton's restricted-API flag cannot carry ':', '=', ',' or spaces)")
    return key


def parse_groups(values: list[str], source: str = "--unrestricted-api") -> tuple[str, ...]:
    """Groups a deployment opens: names from OPTIONAL, given repeated or comma-separated."""
    groups = tuple(g.strip() for v in values for g in v.split(",") if g.strip())
    for g in groups:
        if g in ALWAYS:
            raise AdminKeyError(f"{source}: '{g}' is always restricted (it changes what the server runs)")
        if g not in OPTIONAL:
            raise AdminKeyError(f"{source}: unknown API group '{g}'; choose from {', '.join(OPTIONAL)}")
    return groups


@dataclass(frozen=True)
class AdminAccess:
    key: str
    unrestricted: tuple[str, ...] = ()
    key_file: Optional[str] = None     # where the key is, for operators
    generated: bool = False            # made at start: its file (if any) is ours to remove

    @property
    def restricted(self) -> list[str]:
        return [*ALWAYS, *(g for g in OPTIONAL if g not in self.unrestricted)]

    def server_args(self) -> list[str]:
        spec = f"{','.join(self.restricted)}:{HEADER}={self.key}"
        return [f"--http-restricted-api={spec}", f"--grpc-restricted-protocol={spec}"]

    def headers(self) -> dict[str, str]:
        """For HTTP calls."""
        return {HEADER: self.key}

    def grpc_headers(self) -> dict[str, str]:
        """For gRPC calls: Triton looks for the key under its own prefix there."""
        return {GRPC_PREFIX + HEADER: self.key}

    def env(self) -> dict[str, str]:
        """What a child process (the OpenAI frontend) needs to make the same calls."""
        return {KEY_ENV: self.key}

    def redact(self, argv: list[str]) -> list[str]:
        """A command line fit for a log."""
        return [a.replace(self.key, "<admin-key>") for a in argv]


def resolve(key: Optional[str] = None, key_file: Optional[str] = None, unrestricted: Optional[list[str]] = None,
            write_generated: bool = False, environ: Optional[dict] = None) -> AdminAccess:
    """The key from the argument, TRITON_ADMIN_KEY, or a key file (argument or
    TRITON_ADMIN_KEY_FILE); else a new one, with `write_generated` written to a file only
    this user can read (a fresh private folder under the temp dir; the caller removes it)."""
    environ = os.environ if environ is None else environ
    groups = parse_groups(unrestricted if unrestricted is not None
                          else [environ.get(UNRESTRICTED_ENV, "")], UNRESTRICTED_ENV if unrestricted is None
                          else "--unrestricted-api")
    key_file = key_file or environ.get(KEY_FILE_ENV) or None
    if key:
        return AdminAccess(check_key(key, "--admin-key"), groups)
    if environ.get(KEY_ENV):
        return AdminAccess(check_key(environ[KEY_ENV], KEY_ENV), groups)
    if key_file:
        try:
            with open(key_file, encoding="utf-8") as f:
                return AdminAccess(check_key(f.read(), f"admin key file {key_file}"), groups, key_file)
        except OSError as e:
            raise AdminKeyError(f"admin key file {key_file}: {e.strerror}") from None
    key = secrets.token_urlsafe(32)
    path = None
    if write_generated:
        path = os.path.join(tempfile.mkdtemp(prefix="paged_llm_"), "admin-key")   # mode 0700
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
    return AdminAccess(key, groups, path, generated=True)
