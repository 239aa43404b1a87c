"""GPU check and benchmark, in one call, on one NVIDIA GPU.

    python -m clients.gpu_check --out results/          # writes gpu_check.json and gpu_check.md

1. Kernel correctness on CUDA: the Triton paged-attention tests (tests/unit/attention)
   run natively, plus the engine with attention_backend="triton" against the torch path.
2. Random-weight checkpoints of real architectures, made on the spot (no hub access):
   Llama-3.2-1B, Llama-3.1-8B and Qwen3-0.6B configurations, bf16.
3. Decode throughput and per-token latency at batch 1 and larger batches, and memory
   bandwidth utilization: weight bytes / measured device copy bandwidth is the floor for
   one decode step at batch 1.

STATUS: written without access to a GPU and not yet run on one (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ARCHS = {
    "llama-3.2-1b": dict(arch="LlamaForCausalLM", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         tie_word_embeddings=True, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama-3.1-8b": dict(arch="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         tie_word_embeddings=False, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "qwen3-0.6b": dict(arch="Qwen3ForCausalLM", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=True, rope_theta=1000000.0),
}


def make_checkpoint(name: str, root: str) -> str:
    """Random bf16 weights for the named configuration, written as a checkpoint folder."""
    import transformers as tf
    spec = dict(ARCHS[name])
    arch = spec.pop("arch")
    cfg_cls = tf.Qwen3Config if arch.startswith("Qwen3") else tf.LlamaConfig
    cfg = cfg_cls(max_position_embeddings=8192, initializer_range=0.02, dtype="bfloat16", **spec)
    path = os.path.join(root, name)
    with torch.device("cuda"):
        model = getattr(tf, arch)(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def copy_bandwidth_gbs(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth (reads + writes) in GB/s."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * nbytes * iters / (time.perf_counter() - t0) / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def decode_benchmark(path: str, batch: int, prompt_len: int = 128, new_tokens: int = 128) -> dict:
    from backend import LLM, SamplingParams
    llm = LLM(path, dtype="bfloat16", block_size=16, max_num_seqs=max(batch, 1),
              max_num_batched_tokens=max(2048, batch * prompt_len), gpu_memory_utilization=0.8,
              attention_backend="triton")
    eng = llm.engine
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=4, min_tokens=4, temperature=0))  # warm-up
    for p in prompts:
        eng.add_request(p, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()) \
            or eng.scheduler.waiting:
        eng.step()  # prefill all
    torch.cuda.synchronize()
    t0, steps = time.perf_counter(), 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    wbytes = weight_bytes(eng.model)
    del llm, eng
    torch.cuda.empty_cache()
    return {"batch": batch, "decode_steps": steps, "ms_per_step": 1e3 * dt / steps,
            "tokens_per_s": batch * steps / dt, "weight_bytes": wbytes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clients.gpu_check")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_results"))
    ap.add_argument("--models", nargs="+", default=list(ARCHS))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    a = ap.parse_args(argv)
    assert torch.cuda.is_available(), "needs an NVIDIA GPU"
    os.makedirs(a.out, exist_ok=True)
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "command": "python -m clients.gpu_check " + " ".join(argv or sys.argv[1:])}
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/unit/attention",
                            "tests/unit/engine/test_exactness.py::test_triton_backend_matches_transformers"],
                           capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                                if k != "TRITON_INTERPRET"})
    report["kernel_tests"] = tests.stdout.strip().splitlines()[-1] if tests.stdout.strip() else tests.stderr[-2000:]
    report["copy_bandwidth_gbs"] = copy_bandwidth_gbs()
    report["models"] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as root:
        for name in a.models:
            path = make_checkpoint(name, root)
            rows = [decode_benchmark(path, b) for b in a.batches]
            for r in rows:
                floor_ms = r["weight_bytes"] / (report["copy_bandwidth_gbs"] * 1e9) * 1e3
                r["weight_read_floor_ms"] = floor_ms
                r["x_of_floor"] = r["ms_per_step"] / floor_ms
            report["models"][name] = rows
            print(name, json.dumps(rows), flush=True)
    with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=2)
    lines = [f"GPU: {report['gpu']}, torch {report['torch']}, {report['date']}",
             f"kernel tests: {report['kernel_tests']}",
             f"copy bandwidth: {report['copy_bandwidth_gbs']:.0f} GB/s", "",
             "| model | batch | ms/step | tok/s | weight-read floor ms | x floor |", "|---|---|---|---|---|---|"]
    for name, rows in report["models"].items():
        for r in rows:
            lines.append(f"| {name} | {r['batch']} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:.0f} | "
                         f"{r['weight_read_floor_ms']:.2f} | {r['x_of_floor']:.2f} |")
    with open(os.path.join(a.out, "gpu_check.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
