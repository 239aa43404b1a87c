"""Block-wise FP8 GEMM in OpenAI Triton (DeepSeek-V3 / Qwen3-FP8 checkpoints): out =
sum over K groups of (xq_g @ wq_g^T) * x_scale[:, g] * w_scale[:, g], with xq E4M3
[M, K] quantized per token and group of block_k channels, wq E4M3 [N, K] and w_scale
[N, ceil(K/block_k)] one row per output channel (backend/models/fp8_formats.py expands
the checkpoint's [block_n, block_k] grid to rows).

Each program computes a [BLOCK_M, BLOCK_N] tile; BLOCK_K divides block_k, so every K
step lies in one scale group: an FP8 tl.dot (fp32 accumulate) per step, scaled by the
step's row and column scales into the fp32 accumulator, one rounding at the end. The
torch reference is FP8BlockLinear's dequantized path; with TRITON_INTERPRET=1 the kernel
runs on CPU tensors (CI).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from backend.ops.gemm_tiles import load_rows, load_transposed, output_tile, store_tile

from backend.ops.fp8_quant import quantize_per_group


@triton.jit
def _fp8_block_gemm_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_xs,
                           stride_ws, stride_om, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows, cols, mask_m, mask_n = output_tile(M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask_k = ks < K
        xt = load_rows(x_ptr, rows, ks, mask_m, mask_k, stride_xm)
        wt = load_transposed(w_ptr, cols, ks, mask_n, mask_k, stride_wn)
        g = k0 // GROUP_K
        xs = tl.load(xs_ptr + rows * stride_xs + g, mask=mask_m, other=0.0)
        ws = tl.load(ws_ptr + cols * stride_ws + g, mask=mask_n, other=0.0)
        acc += tl.dot(xt, wt) * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    store_tile(out_ptr, acc, rows, cols, mask_m, mask_n, stride_om)


def fp8_block_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block_k: int,
                   bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] (any float dtype) -> [M, N] in x's dtype."""
    M, K = x.shape
    N = weight.shape[0]
    block = min(block_k, 64)            # K steps inside one scale group; FP8 MMAs want K >= 32
    if block_k not in (32, 64) and block_k % 64:
        raise ValueError(f"the block FP8 kernel needs block_k 32 or a multiple of 64, got {block_k}")
    xq, xs = quantize_per_group(x, block_k)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_m = 16 if M <= 16 else 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, 64))
    _fp8_block_gemm_kernel[grid](xq, weight, xs, weight_scale, bias if bias is not None else weight_scale, out, M, N,
                                 K, xq.stride(0), weight.stride(0), xs.stride(0), weight_scale.stride(0),
                                 out.stride(0), GROUP_K=block_k, HAS_BIAS=bias is not None, BLOCK_M=block_m,
                                 BLOCK_N=64, BLOCK_K=block)
    return out
