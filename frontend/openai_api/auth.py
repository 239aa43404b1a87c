"""API keys of the OpenAI-compatible frontend, as `vllm serve --api-key` checks them.

Every `/v1/*` route, `/tokenize` and `/detokenize` need `Authorization: Bearer <key>`;
`/health`, `/metrics` (counts and latencies only), `/openapi.json` and `/docs` stay open
(probes, scrapers and schema tools). Several keys may be valid at once, so that a
key can be rotated without downtime: add the new one, move clients, drop the old one.
Keys come from `--api-key` (repeatable), `API_KEY` (comma-separated) and the file
`API_KEY_FILE` (one key per line) names.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Iterable, Optional

PROTECTED_PREFIX = "/v1"
# Beside /v1 as in vLLM, but keyed here: they run the tokenizer (work) for the caller.
PROTECTED_PATHS = ("/tokenize", "/detokenize")


def protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/") or path in PROTECTED_PATHS


class APIKeys:
    def __init__(self, keys: Iterable[str] = ()) -> None:
        # Digests are compared, not keys: equal lengths, so the time taken does not even
        # tell a key's length.
        self._keys = [_digest(k) for k in dict.fromkeys(k.strip() for k in keys) if k]

    def __bool__(self) -> bool:
        return bool(self._keys)

    @classmethod
    def from_sources(cls, cli: Optional[list[str]] = None, environ: Optional[dict] = None) -> "APIKeys":
        environ = os.environ if environ is None else environ
        keys = [k for value in (cli or []) for k in value.split(",")]
        keys += environ.get("API_KEY", "").split(",")
        if environ.get("API_KEY_FILE"):
            with open(environ["API_KEY_FILE"], encoding="utf-8") as f:
                keys += f.read().splitlines()
        return cls(keys)

    def allows(self, authorization: Optional[str]) -> bool:
        """True when the header carries one of the keys. Every key is compared, in constant
        time, whatever matches: the time taken says nothing about the keys."""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        given = _digest(token)
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(given, key)
        return matched and bool(token)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
