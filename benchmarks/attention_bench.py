"""Paged attention kernels against the memory-bandwidth floor, on one GPU.

    python -m benchmarks.attention_bench            # also run by benchmarks.gpu_check

For decode and prefill shapes of the Llama-3.2-1B configuration (32 query heads, 8 KV
heads, head dim 64, bf16, 16-token blocks scattered in the pool), times the one-token
split-KV kernel and the tensor-core tiled kernel (for decode also with 4-token tiles, 16
rows with GQA 4). The floor is the
bytes of K/V (and q, out) each launch must read, over the measured copy bandwidth. The
kernels' outputs are compared with each other too.

These figures route decode steps (`backend/attention/triton_attention.py`,
`paged_attention`): on the first H100 run (2026-11-27) the tiled kernel with 4-token tiles
took 0.09 ms against the one-token kernel's 0.40 at batch 64 and 0.25 against 1.25 at
batch 256 (1k context), so unsplit decode with GQA >= 4 goes to it; batch 1 at 4k context
(split-KV, 0.088 against 0.113 ms) stays on the one-token kernel.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable

import torch

# (name, sequences, cached context per sequence, new tokens per sequence)
SHAPES = [("decode b1 ctx4096", 1, 4095, 1), ("decode b64 ctx1024", 64, 1023, 1),
          ("decode b256 ctx1024", 256, 1023, 1), ("prefill 4x1024", 4, 0, 1024)]


def _time_ms(fn: Callable[[], None], iters: int, device: torch.device) -> float:
    fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def bench_shape(name: str, num_seqs: int, ctx: int, new: int, bandwidth_gbs: float, device: torch.device,
                heads: int = 32, kv_heads: int = 8, head_dim: int = 64, block_size: int = 16,
                dtype: torch.dtype = torch.bfloat16, iters: int = 20) -> list[dict]:
    from backend.attention.triton_attention import choose_num_splits, launch_paged_attention
    from backend.attention.triton_tiled import launch_tiled_attention
    g = torch.Generator(device=device).manual_seed(0)
    seq_len = ctx + new
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * blocks_per_seq + 1
    pool_shape = (num_blocks, block_size, kv_heads, head_dim)
    k_pool = torch.randn(pool_shape, generator=g, device=device).to(dtype)
    v_pool = torch.randn(pool_shape, generator=g, device=device).to(dtype)
    perm = torch.randperm(num_blocks - 1, generator=g, device=device) + 1           # scattered blocks
    block_tables = perm[:num_seqs * blocks_per_seq].view(num_seqs, blocks_per_seq).to(torch.int32)
    T = num_seqs * new
    q = torch.randn(T, heads, head_dim, generator=g, device=device).to(dtype)
    k = torch.randn(T, kv_heads, head_dim, generator=g, device=device).to(dtype)
    v = torch.randn(T, kv_heads, head_dim, generator=g, device=device).to(dtype)
    slots = torch.full((T,), -1, dtype=torch.int32, device=device)   # timing only: write nothing
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device)
    qsl = torch.arange(0, T + 1, new, dtype=torch.int32, device=device)
    scales = torch.ones(2, dtype=torch.float32, device=device)
    args = (q, k, v, k_pool, v_pool, slots, block_tables, seq_lens, qsl, scales[0:1], scales[1:2])
    scale = head_dim ** -0.5
    splits = choose_num_splits(T, kv_heads, seq_len, block_size) if new == 1 else 1
    kernels = {f"one-token (splits {splits})": lambda out: launch_paged_attention(*args, out, scale, None, splits),
               "tiled 16-token tiles": lambda out: launch_tiled_attention(*args, out, scale)}
    if new == 1:
        kernels["tiled 4-token tiles"] = lambda out: launch_tiled_attention(*args, out, scale, block_m=4)
    item = torch.tensor([], dtype=dtype).element_size()
    bytes_read = (num_seqs * seq_len * kv_heads * head_dim * 2 + 2 * T * heads * head_dim) * item
    floor_ms = bytes_read / (bandwidth_gbs * 1e9) * 1e3
    rows, ref = [], None
    for kname, launch in kernels.items():
        out = torch.zeros_like(q)
        ms = _time_ms(lambda: launch(out), iters, device)
        ref = out if ref is None else ref
        diff = (out.float() - ref.float()).abs().max().item()
        rows.append({"shape": name, "kernel": kname, "ms": ms, "floor_ms": floor_ms, "x_floor": ms / floor_ms,
                     "GB_per_s": bytes_read / ms / 1e6, "max_abs_diff_vs_first": diff})
    return rows


def run(bandwidth_gbs: float, device: torch.device, shapes=SHAPES, **kw) -> list[dict]:
    return [r for shape in shapes for r in bench_shape(*shape, bandwidth_gbs, device, **kw)]


def render(rows: list[dict]) -> str:
    lines = ["| shape | kernel | ms | floor ms | x floor | GB/s | max diff |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['kernel']} | {r['ms']:.3f} | {r['floor_ms']:.3f} | {r['x_floor']:.2f} | "
              f"{r['GB_per_s']:.0f} | {r['max_abs_diff_vs_first']:.2g} |" for r in rows]
    return "\n".join(lines)


def gpu_main(prog: str, run_rows: Callable, render_rows: Callable, argv=None) -> int:
    """A kernel benchmark's command line: run on the GPU against the measured copy
    bandwidth, print the table, optionally write the rows as JSON."""
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks.{prog}")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{prog} needs an NVIDIA GPU")
        return 2
    from benchmarks.device_bandwidth import copy_bandwidth_gbs
    rows = run_rows(copy_bandwidth_gbs(), torch.device("cuda"))
    print(render_rows(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def main(argv=None) -> int:
    return gpu_main("attention_bench", run, render, argv)


if __name__ == "__main__":
    sys.exit(main())
