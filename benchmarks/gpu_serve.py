"""The product on the GPU (issue 50 part 7): Triton server 2.51 with our backend serving a
Llama-3.2-1B-shaped random model in bf16, streamed over gRPC at concurrency 256, against
the offline engine on the same workload and engine settings, in the same call.

    make gpu-bundle                                   # here, once: .gpu/serve/bundle.tar.xz
    # the device call (carry .gpu/serve):
    tar -xJf .gpu/serve/bundle.tar.xz && export PYTHONPATH=$PWD/third_party/site:$PWD && \\
        python -m benchmarks.gpu_serve --out $OUT

The server comes from the bundle (benchmarks/gpu_bundle.py) and is laid out by
`clients.tritonserver install`, as `make serve` does; the entry is the builder's; the
measurement is benchmarks/bench.py's `serve` (target: served output tok/s >= 0.9x
offline). Prepared on a machine without a GPU; never run on one yet.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# The nano-vllm workload's lengths, fewer requests: about 1 minute at the offline rate.
WORKLOAD = ["--num-seqs", "1024", "--input-len", "100", "1024", "--output-len", "100", "1024"]


def build_entry(checkpoint: str, repository: str, max_num_seqs: int = 256) -> str:
    """The builder's model-repository entry `llm` for `checkpoint` (linked, not copied)."""
    from builder.__main__ import main as builder_main
    entry = os.path.join(repository, "llm")
    if builder_main(["build", "--checkpoint", checkpoint, "--output", entry, "--link", "--no-perplexity",
                     "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", "8192",
                     "--max-model-len", "4096"]) != 0:
        raise RuntimeError(f"the builder could not make an entry of {checkpoint}")
    return entry


def serve_args(repository: str, concurrency: int, workload: list[str], json_path: str) -> list[str]:
    return ["serve", "--start-server", "--model-repository", repository, "--concurrency", str(concurrency),
            *workload, "--json", json_path]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_results"))
    ap.add_argument("--concurrency", type=int, default=256)
    a = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("gpu_serve needs an NVIDIA GPU")
        return 2
    from benchmarks import bench
    from benchmarks.gpu_perf_stages import ensure_checkpoint
    from clients.tritonserver import install
    os.makedirs(a.out, exist_ok=True)
    work = os.path.join(os.environ.get("TMPDIR", "/tmp"), "paged_llm_gpu_serve")
    install()
    repository = os.path.join(work, "repository")
    build_entry(ensure_checkpoint("llama-3.2-1b", work), repository, a.concurrency)
    raw = os.path.join(a.out, "gpu_serve_raw.json")
    bench.main(serve_args(repository, a.concurrency, WORKLOAD, raw))
    with open(raw) as f:
        report = json.load(f)
    summary = {"offline_tok_s": report.get("offline_tok_s"), "runs": [r["summary"] for r in report["runs"]]}
    with open(os.path.join(a.out, "gpu_serve.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
