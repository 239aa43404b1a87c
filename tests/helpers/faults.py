"""Builds test model repositories whose backend carries the fault-injection hook of
tests/helpers/fault_model/model.py, and pulls its trigger."""

from __future__ import annotations

import os
import re
import shutil

from builder.build import BuildOptions, build

HOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_model", "model.py")


def build_fault_repo(root: str, checkpoint: str, name: str = "llm", params: dict | None = None,
                     hooked: bool = True, **opts) -> str:
    """A repository with one model `name`: our backend, run by Triton's python backend
    from the hooked model.py (hooked=False: as users run it, backend "paged_llm", which
    the OpenAI frontend serves; faults then come from outside: signals). Returns the
    repository path."""
    repo = os.path.join(root, "repo")
    model_dir = os.path.join(repo, name)
    base = dict(checkpoint=checkpoint, output=model_dir, name=name, link=True, block_size=16,
                num_kv_blocks=128, max_model_len=1024)
    build(BuildOptions.create(**{**base, **opts}), log=lambda *_: None)
    config = os.path.join(model_dir, "config.pbtxt")
    with open(config) as f:
        text = f.read()
    if hooked:
        text = re.sub(r'backend:\s*"paged_llm"', 'backend: "python"', text)
    for key, value in (params or {}).items():
        text += f'\nparameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
    with open(config, "w") as f:
        f.write(text)
    if hooked:
        shutil.copy(HOOK, os.path.join(model_dir, "1", "model.py"))
    return repo


def trigger(repo: str, fault: str, name: str = "llm") -> None:
    """The next engine step of model `name` injects `fault` (crash, stall, hang_gil)."""
    path = os.path.join(repo, name, "fault_trigger")
    with open(path + ".tmp", "w") as f:
        f.write(fault)
    os.replace(path + ".tmp", path)


def backend_pid(repo: str, instance: str = "llm_0_0") -> int:
    """The pid of the python-backend stub serving `instance` from `repo`."""
    from supervisor.processes import stubs_of
    for stub in stubs_of():
        if stub.model_path.startswith(repo) and stub.instance == instance:
            return stub.pid
    raise LookupError(f"no backend process for {instance} of {repo}")
