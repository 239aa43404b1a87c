"""Run Triton's perf_analyzer (shipped in the tritonclient 2.51.0 wheel) against the
model over gRPC streaming, and parse its summary.

    python -m benchmarks.perf_analyzer --url 127.0.0.1:8001 --concurrency 4 --seconds 5
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Optional

from clients.tritonserver import EXTRA_LIBS, install

PA_LINE = re.compile(r"Concurrency: (\d+), throughput: ([\d.]+) infer/sec, latency (\d+) usec")


def perf_analyzer_binary() -> str:
    return os.path.join(os.path.dirname(sys.executable), "perf_analyzer")


def input_data(prompt: str, max_tokens: int, contract: str = "vllm") -> dict:
    if contract == "tensorrtllm":  # ensemble / tensorrt_llm_bls, as TensorRT-LLM's docs feed them
        return {"data": [{"text_input": [prompt], "stream": [True], "max_tokens": [max_tokens],
                          "min_length": [max_tokens], "end_id": [-1]}]}
    return {"data": [{"text_input": [prompt], "stream": [True],
                      "sampling_parameters": [json.dumps({"max_tokens": max_tokens, "min_tokens": max_tokens,
                                                          "ignore_eos": True})]}]}


def command(url: str, model: str, data_file: str, concurrency: int, seconds: float, max_trials: int = 3) -> list[str]:
    return [perf_analyzer_binary(), "-m", model, "-u", url, "-i", "grpc", "--streaming",
            "--input-data", data_file, "--concurrency-range", str(concurrency),
            "--measurement-interval", str(int(seconds * 1000)), "--max-trials", str(max_trials),
            "--stability-percentage", "100"]


def run(url: str, model: str = "llm", concurrency: int = 2, seconds: float = 2.0, max_tokens: int = 16,
        prompt: str = "The assert statement", contract: str = "vllm", max_trials: int = 3) -> dict:
    """`max_trials`: measurement windows perf_analyzer may take to find three within
    --stability-percentage of each other (more for a smoke run on a busy machine)."""
    install()  # provides libb64 and libcudart under the names perf_analyzer links against
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(input_data(prompt, max_tokens, contract), f)
    env = dict(os.environ, LD_LIBRARY_PATH=EXTRA_LIBS + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
    cmd = command(url, model, f.name, concurrency, seconds, max_trials)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    os.unlink(f.name)
    if proc.returncode != 0:
        raise RuntimeError(f"perf_analyzer failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    m = PA_LINE.search(proc.stdout)
    if not m:
        raise RuntimeError(f"could not parse perf_analyzer output:\n{proc.stdout}")
    return {"concurrency": int(m.group(1)), "infer_per_s": float(m.group(2)), "latency_us": int(m.group(3)),
            "command": " ".join(cmd), "output": proc.stdout}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.perf_analyzer")
    ap.add_argument("--url", default="127.0.0.1:8001")
    ap.add_argument("--contract", default="vllm", choices=["vllm", "tensorrtllm"],
                    help="tensorrtllm: TensorRT-LLM's inputs, for -m ensemble or tensorrt_llm_bls")
    ap.add_argument("--model", help="default: llm (vllm), ensemble (tensorrtllm)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args(argv)
    model = a.model or ("ensemble" if a.contract == "tensorrtllm" else "llm")
    r = run(a.url, model, a.concurrency, a.seconds, a.max_tokens, contract=a.contract)
    print(r["output"])
    print(json.dumps({k: v for k, v in r.items() if k != "output"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
