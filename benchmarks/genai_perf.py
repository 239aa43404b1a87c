"""Run NVIDIA genai-perf against the model, as Triton's vLLM backend is benchmarked
(`--backend vllm --endpoint-type kserve`, gRPC streaming, tokenizer from the model folder),
or as TensorRT-LLM's is (`--backend tensorrtllm -m ensemble`, the entries `builder
default` writes in front of `llm`).

    python -m benchmarks.genai_perf --url localhost:8001 --concurrency 4
    python -m benchmarks.genai_perf --url localhost:8001 --backend tensorrtllm --model ensemble

genai-perf 0.0.16 needs numpy 2, while tritonclient 2.51 (our client and perf_analyzer)
needs numpy < 2, so it gets its own virtual environment in third_party/genai-perf-venv.
It drives the perf_analyzer binary of the project's venv.
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import json
import os
import subprocess
import sys
import threading
from typing import Optional

from clients.tritonserver import EXTRA_LIBS, THIRD_PARTY, install

VENV = os.path.join(THIRD_PARTY, "genai-perf-venv")
SPEC = "genai-perf==0.0.16"


_VENV_LOCK = threading.Lock()


def ensure_venv() -> str:
    exe = os.path.join(VENV, "bin", "genai-perf")
    # A caller waits for an install already under way: in this process (the lock) or in
    # another (the file lock: make test's two workers both prepare it).
    os.makedirs(THIRD_PARTY, exist_ok=True)
    with _VENV_LOCK, open(VENV + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(exe):
            subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
            subprocess.run([os.path.join(VENV, "bin", "python"), "-m", "pip", "install", "-q", SPEC], check=True)
    return exe


def prepare_in_background() -> None:
    """Start installing the venv on a thread (about a minute on a fresh machine), so that
    a test suite can do other work meanwhile; ensure_venv() then waits for it."""
    if not os.path.isfile(os.path.join(VENV, "bin", "genai-perf")):
        threading.Thread(target=ensure_venv, name="genai-perf-venv", daemon=True).start()


def command(exe: str, url: str, model: str, tokenizer: str, concurrency: int, input_tokens: int,
            output_tokens: int, measurement_ms: int, entries: int, artifact_dir: str, backend: str = "vllm",
            request_count: Optional[int] = None) -> list[str]:
    # A fixed request count measures exactly that many requests, however slow the machine;
    # time windows can close with none finished on a loaded CI box, and perf_analyzer then
    # leaves an empty profile export. (It also does when a response lacks an FP32 output
    # it asked for and the garbage it reads there is a NaN: docs/reliability.md.)
    window = (["--request-count", str(request_count)] if request_count
              else ["--measurement-interval", str(measurement_ms)])
    return [exe, "profile", "-m", model, "--backend", backend, "--endpoint-type", "kserve", "--streaming",
            "--tokenizer", tokenizer, "-u", url, "--synthetic-input-tokens-mean", str(input_tokens),
            "--output-tokens-mean", str(output_tokens), "--concurrency", str(concurrency), *window,
            "--num-dataset-entries", str(entries), "--artifact-dir", artifact_dir, "--verbose"]


def run(url: str, tokenizer: str, model: str = "llm", concurrency: int = 4, input_tokens: int = 128,
        output_tokens: int = 64, measurement_ms: int = 4000, entries: int = 50,
        artifact_dir: str = os.path.join(THIRD_PARTY, "genai-perf-artifacts"), backend: str = "vllm",
        request_count: Optional[int] = None) -> dict:
    install()
    exe = ensure_venv()
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               LD_LIBRARY_PATH=EXTRA_LIBS + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
    cmd = command(exe, url, model, tokenizer, concurrency, input_tokens, output_tokens, measurement_ms, entries,
                  artifact_dir, backend, request_count)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=THIRD_PARTY)
    if proc.returncode != 0:
        # --verbose puts perf_analyzer's own messages in stdout: they say why, the traceback doesn't
        raise RuntimeError(f"genai-perf failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")
    exports = sorted(glob.glob(os.path.join(artifact_dir, "**", "profile_export_genai_perf.json"), recursive=True),
                     key=os.path.getmtime)
    with open(exports[-1]) as f:
        report = json.load(f)
    report["command"] = " ".join(cmd)
    return report


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.genai_perf")
    ap.add_argument("--url", default="localhost:8001")
    ap.add_argument("--backend", default="vllm", choices=["vllm", "tensorrtllm"])
    ap.add_argument("--model", help="default: llm (vllm), ensemble (tensorrtllm)")
    ap.add_argument("--tokenizer", default=os.path.join(os.path.dirname(THIRD_PARTY), "model_repository", "llm",
                                                        "checkpoint"))
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--input-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    a = ap.parse_args(argv)
    model = a.model or ("ensemble" if a.backend == "tensorrtllm" else "llm")
    r = run(a.url, a.tokenizer, model, a.concurrency, a.input_tokens, a.output_tokens, backend=a.backend)
    for key in ("time_to_first_token", "inter_token_latency", "request_latency", "output_token_throughput",
                "request_throughput"):
        print(f"{key}: {json.dumps(r[key])}")
    print(r["command"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
