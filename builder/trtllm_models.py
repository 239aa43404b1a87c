"""Model-repository entries in TensorRT-LLM's names, in front of a model of ours.

`ensemble` and `tensorrt_llm_bls` (text in and out) and `tensorrt_llm` (token ids in and
out) are what TensorRT-LLM's clients, genai-perf `--backend tensorrtllm` and users'
scripts call. Each is a config.pbtxt and an empty version folder: the backend forwards
to the named model over BLS (backend/triton_server/trtllm_front.py), so one engine and
one copy of the weights serve every name.
"""

from __future__ import annotations

import os

FRONTS = {"ensemble": "text", "tensorrt_llm_bls": "text", "tensorrt_llm": "tokens"}


def render_front_config(name: str, contract: str, llm_model: str, max_batch_size: int, instances: int) -> str:
    return "\n".join([
        f'name: "{name}"',
        'backend: "paged_llm"',
        f"max_batch_size: {max_batch_size}",
        "model_transaction_policy { decoupled: true }",
        "# Each instance serves one request at a time, start to end (as TensorRT-LLM's BLS):",
        "# the count is how many of this model's requests stream at once.",
        f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]",
        "# TensorRT-LLM's inputs and outputs are filled in by the backend (auto-complete).",
        f'parameters {{ key: "trtllm_contract" value: {{ string_value: "{contract}" }} }}',
        f'parameters {{ key: "llm_model" value: {{ string_value: "{llm_model}" }} }}',
        "",
    ])


def write_fronts(repository: str, llm_model: str = "llm", max_batch_size: int = 64, force: bool = False,
                 instances: int = 4) -> list[str]:
    """Write the three entries next to `llm_model` in `repository`; returns those written."""
    written = []
    for name, contract in FRONTS.items():
        folder = os.path.join(repository, name)
        path = os.path.join(folder, "config.pbtxt")
        if os.path.isfile(path) and not force:
            continue
        os.makedirs(os.path.join(folder, "1"), exist_ok=True)
        with open(path, "w") as f:
            f.write(render_front_config(name, contract, llm_model, max_batch_size, instances))
        written.append(name)
    return written
