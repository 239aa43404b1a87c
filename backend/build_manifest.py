"""The build manifest: what the builder produced, checked by the backend at load.

A model-repository entry built for another layout or another backend version fails to
load with a message that says what differs, instead of serving wrong numbers.
"""

from __future__ import annotations

import json
import os
from typing import Any

from backend.config import ConfigError, EngineArgs

MANIFEST_NAME = "build_manifest.json"
FORMAT_VERSION = 1
BACKEND_VERSION = "0.1.0"


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def read_manifest(model_dir: str) -> dict[str, Any] | None:
    path = os.path.join(model_dir, MANIFEST_NAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def check_manifest(model_dir: str, engine_args: EngineArgs) -> None:
    """No manifest (a hand-written entry) is fine; a manifest must match this backend."""
    m = read_manifest(model_dir)
    if m is None:
        return
    problems = []
    if m.get("format_version") != FORMAT_VERSION:
        problems.append(f"manifest format_version is {m.get('format_version')!r}, this backend reads "
                        f"{FORMAT_VERSION}")
    built = m.get("backend_version", "?")
    if _minor(built) != _minor(BACKEND_VERSION):
        problems.append(f"built by backend {built}, this is backend {BACKEND_VERSION} (minor versions must match)")
    kv = m.get("options", {}).get("kv_cache")
    if kv is not None and kv != engine_args.kv_cache_dtype:
        problems.append(f"built for kv_cache_dtype '{kv}', config.pbtxt asks for '{engine_args.kv_cache_dtype}'")
    engine = m.get("options", {}).get("engine", "torch")
    if engine != engine_args.model_runner:
        problems.append(f"built for the '{engine}' engine, config.pbtxt asks for model_runner "
                        f"'{engine_args.model_runner}'")
    if problems:
        raise ConfigError(f"model in '{model_dir}' does not match this backend: " + "; ".join(problems)
                          + ". Rebuild it with `python -m builder build`.")
