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


EXIT_LINE = (r"KV blocks in use at exit: (?P<used>\d+) of \d+; requests finished: (?P<finished>\d+), "
             r"cancelled: (?P<cancelled>\d+); preemptions: (?P<preemptions>\d+); KV blocks received: "
             r"(?P<received>\d+), prompts computed here instead: (?P<fallbacks>\d+)")


def exit_report(log: str) -> dict[str, int]:
    """A stopped worker's last line (backend/dynamo_worker/worker.py), as numbers."""
    import re
    found = re.search(EXIT_LINE, log)
    assert found, log[-3000:]
    return {k: int(v) for k, v in found.groupdict().items()}


@pytest.fixture(scope="module")
def offline(trained_ckpt):
    """The trained reference model in our engine, in the test's process: what Dynamo
    must answer."""
    from backend.llm import LLM
    with LLM(trained_ckpt, num_kv_blocks=64, max_model_len=1024) as llm:
        yield llm


def greedy(llm, prompt: str, max_tokens: int, ignore_eos: bool = False):
    from backend.sampling_params import SamplingParams
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos))[0]
