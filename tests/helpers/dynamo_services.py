"""What the Dynamo tests need beside clients/dynamo_local.py (which starts the processes):
a skip where NATS, etcd or Dynamo is missing (a failure in CI, where `make dynamo`
installs them), and Prometheus sums."""

from __future__ import annotations

import os
import shutil

import pytest

SERVICES = ("nats-server", "etcd")


def require_services() -> None:
    missing = [name for name in SERVICES if shutil.which(name) is None]
    try:
        import dynamo.llm  # noqa: F401
    except ImportError:
        missing.append("ai-dynamo (requirements/dynamo.txt)")
    if missing:
        message = f"not installed: {', '.join(missing)} (`make dynamo` installs them)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


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
