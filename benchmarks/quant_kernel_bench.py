"""W8A8 INT8 GEMM and the INT8 KV cache against bf16, on one GPU (issue 33).

    python -m benchmarks.quant_kernel_bench         # also run by benchmarks.gpu_check

- W8A8: a Llama-3.1-8B layer's gate_up and down projections at decode and prefill row
  counts. The W8A8 time is what `W8A8Linear` does on CUDA: per-token activation
  quantization, then the Triton int8 GEMM (backend/ops/w8a8_gemm_triton.py); bf16 is
  `F.linear` (cuBLAS) on the same shape. Each row also gives the kernel's largest
  difference from the exact integer reference on the same quantized inputs.
- INT8 KV: the one-token paged attention kernel on decode shapes over an INT8 pool (per
  KV-head scales) and over a bf16 pool of the same blocks: half the K/V bytes read. The
  floor is the bf16 pool's bytes over the measured copy bandwidth.

Speed-up = bf16 ms / quantized ms. Never run on a GPU yet (no GPU lent to the session
that wrote it): on CPU it runs through the interpreter on tiny shapes only (its test).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from benchmarks.attention_bench import _time_ms, gpu_main

# (name, rows, in features, out features): Llama-3.1-8B's gate_up and down.
GEMM_SHAPES = [(f"{p} M={m}", m, k, n) for m in (1, 16, 256, 2048)
               for p, k, n in (("gate_up 4096x28672", 4096, 28672), ("down 14336x4096", 14336, 4096))]
# (name, sequences, context): decode steps of Llama-3.1-8B's attention (32/8 heads, dim 128).
KV_SHAPES = [("decode b1 ctx8192", 1, 8192), ("decode b64 ctx2048", 64, 2048), ("decode b256 ctx1024", 256, 1024)]


def w8a8_rows(bandwidth_gbs: float, device: torch.device, shapes=GEMM_SHAPES, dtype: torch.dtype = torch.bfloat16,
              iters: int = 20) -> list[dict]:
    from backend.models.w8a8 import int8_gemm_reference, quantize_per_token
    from backend.ops.w8a8_gemm_triton import w8a8_gemm
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, M, K, N in shapes:
        x = torch.randn(M, K, generator=g, device=device).to(dtype)
        w = (torch.randn(N, K, generator=g, device=device) / K ** 0.5).to(dtype)
        wq, w_scale = quantize_per_token(w)             # per output channel: the same rule on w's rows

        def w8a8() -> torch.Tensor:
            xq, x_scale = quantize_per_token(x)
            return w8a8_gemm(xq, x_scale, wq, w_scale, None, dtype)
        bf16_ms = _time_ms(lambda: F.linear(x, w), iters, device)
        ms = _time_ms(w8a8, iters, device)
        xq, x_scale = quantize_per_token(x)
        ref = int8_gemm_reference(xq, x_scale, wq, w_scale, None, torch.float32)
        floor_ms = (N * K + M * K * 2 + M * N * 2) / (bandwidth_gbs * 1e9) * 1e3
        rows.append({"shape": name, "bf16_ms": bf16_ms, "w8a8_ms": ms, "speedup": bf16_ms / ms,
                     "floor_ms": floor_ms, "x_floor": ms / floor_ms,
                     "max_abs_diff_vs_exact": (w8a8().float() - ref).abs().max().item()})
    return rows


def int8_kv_rows(bandwidth_gbs: float, device: torch.device, shapes=KV_SHAPES, heads: int = 32, kv_heads: int = 8,
                 head_dim: int = 128, block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
                 iters: int = 20) -> list[dict]:
    from backend.attention.torch_attention import quantize_int8
    from backend.attention.triton_attention import choose_num_splits, launch_paged_attention
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, num_seqs, ctx in shapes:
        seq_len = ctx + 1
        per_seq = -(-seq_len // block_size)
        num_blocks = num_seqs * per_seq + 1
        k_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g, device=device).to(dtype)
        v_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g, device=device).to(dtype)
        k_scale = k_pool.float().abs().amax(dim=(0, 1, 3)) / 127.0          # per KV head
        v_scale = v_pool.float().abs().amax(dim=(0, 1, 3)) / 127.0
        k8, v8 = quantize_int8(k_pool, k_scale), quantize_int8(v_pool, v_scale)
        perm = torch.randperm(num_blocks - 1, generator=g, device=device) + 1
        tables = perm[:num_seqs * per_seq].view(num_seqs, per_seq).to(torch.int32)
        q = torch.randn(num_seqs, heads, head_dim, generator=g, device=device).to(dtype)
        k = torch.randn(num_seqs, kv_heads, head_dim, generator=g, device=device).to(dtype)
        v = torch.randn(num_seqs, kv_heads, head_dim, generator=g, device=device).to(dtype)
        slots = torch.full((num_seqs,), -1, dtype=torch.int32, device=device)   # timing only: write nothing
        seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device)
        qsl = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
        ones = torch.ones(1, dtype=torch.float32, device=device)
        splits = choose_num_splits(num_seqs, kv_heads, seq_len, block_size)
        scale = head_dim ** -0.5
        out16, out8 = torch.empty_like(q), torch.empty_like(q)

        def bf16() -> None:
            launch_paged_attention(q, k, v, k_pool, v_pool, slots, tables, seq_lens, qsl, ones, ones, out16, scale,
                                   None, splits)

        def int8() -> None:
            launch_paged_attention(q, k, v, k8, v8, slots, tables, seq_lens, qsl, k_scale, v_scale, out8, scale,
                                   None, splits)
        bf16_ms, ms = _time_ms(bf16, iters, device), _time_ms(int8, iters, device)
        bytes16 = num_seqs * seq_len * kv_heads * head_dim * 2 * torch.tensor([], dtype=dtype).element_size()
        floor_ms = bytes16 / (bandwidth_gbs * 1e9) * 1e3
        rows.append({"shape": name, "bf16_ms": bf16_ms, "int8_ms": ms, "speedup": bf16_ms / ms,
                     "bf16_floor_ms": floor_ms, "int8_floor_ms": floor_ms / 2,
                     "max_abs_diff_vs_bf16": (out8.float() - out16.float()).abs().max().item()})
    return rows


def run(bandwidth_gbs: float, device: torch.device, gemm_shapes=GEMM_SHAPES, kv_shapes=KV_SHAPES, **kw) -> dict:
    return {"w8a8": w8a8_rows(bandwidth_gbs, device, gemm_shapes, **kw),
            "int8_kv": int8_kv_rows(bandwidth_gbs, device, kv_shapes, **kw)}


def render(report: dict) -> str:
    lines = ["| W8A8 GEMM | bf16 ms | W8A8 ms | speed-up | floor ms | x floor | max diff vs exact |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['bf16_ms']:.3f} | {r['w8a8_ms']:.3f} | {r['speedup']:.2f} | {r['floor_ms']:.3f} | "
              f"{r['x_floor']:.2f} | {r['max_abs_diff_vs_exact']:.2g} |" for r in report["w8a8"]]
    lines += ["", "| INT8 KV attention | bf16 ms | INT8 ms | speed-up | bf16 floor ms | INT8 floor ms | max diff |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['bf16_ms']:.3f} | {r['int8_ms']:.3f} | {r['speedup']:.2f} | "
              f"{r['bf16_floor_ms']:.3f} | {r['int8_floor_ms']:.3f} | {r['max_abs_diff_vs_bf16']:.2g} |"
              for r in report["int8_kv"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    return gpu_main("quant_kernel_bench", run, render, argv)


if __name__ == "__main__":
    sys.exit(main())
