"""W8A8 INT8 GEMM in OpenAI Triton: out = (xq @ wq^T) * x_scale[:, None] * w_scale[None, :]
(+ bias), with xq int8 [M, K] quantized per token, wq int8 [N, K] per output channel.

Each program computes a [BLOCK_M, BLOCK_N] tile: int8 x int8 tl.dot accumulating in
int32 (exact: |sum| <= K * 128^2 fits int32 for K < 131072), then one float32 epilogue
multiplies by the row (token) and column (channel) scales, adds the bias and rounds once
to the output dtype. On Hopper the int8 dot maps to the INT8 tensor-core MMA. At decode
sizes K is split across programs (backend/ops/gemm_tiles.launch): each split scales its
own int32 sum, the bias goes with the first, and the fp32 partials are summed in order.
Tiles per M bucket in `TILES`: a 16-row tile at decode, the common 128x128 above; not
yet measured on a GPU. The exact torch reference is
backend/models/w8a8.int8_gemm_reference; with TRITON_INTERPRET=1 the kernel runs on CPU
tensors (CI).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from backend.ops.gemm_tiles import launch, load_rows, load_transposed, output_tile, store_result

# (largest M, BLOCK_M, BLOCK_N, num_warps, num_stages). ptxas for sm_90, compiled as a
# launch specializes it (python -m benchmarks.kernel_resources): 16x64x64 takes 48
# registers (10 programs an SM), 128x128x64 with 8 warps 116 and 48 KB of shared memory
# (2); neither spills, and both pipeline the K loop.
TILES = ((16, 16, 64, 4, 4), (1 << 62, 128, 128, 8, 3))
BLOCK_K = 64


@triton.jit
def _w8a8_gemm_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                      stride_os, K_PER_SPLIT, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    rows, cols, mask_m, mask_n = output_tile(M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    k_lo = tl.program_id(2) * K_PER_SPLIT
    for k0 in range(k_lo, tl.minimum(k_lo + K_PER_SPLIT, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask_k = ks < K
        xt = load_rows(x_ptr, rows, ks, mask_m, mask_k, stride_xm)
        wt = load_transposed(w_ptr, cols, ks, mask_n, mask_k, stride_wn)
        acc += tl.dot(xt, wt, out_dtype=tl.int32)
    xs = tl.load(xs_ptr + rows, mask=mask_m, other=0.0)
    ws = tl.load(ws_ptr + cols, mask=mask_n, other=0.0)
    out = acc.to(tl.float32) * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        if tl.program_id(2) == 0:
            out += tl.load(b_ptr + cols, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    store_result(out_ptr, out, rows, cols, mask_m, mask_n, stride_om, stride_os)


def w8a8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
              bias: Optional[torch.Tensor], out_dtype: torch.dtype, split_k: Optional[int] = None) -> torch.Tensor:
    """xq int8 [M, K], x_scale fp32 [M], wq int8 [N, K], w_scale fp32 [N] -> [M, N]
    (split_k: a forced number of K splits, for tests and tuning)."""
    xq = xq.contiguous()
    M, K = xq.shape
    N = wq.shape[0]
    assert wq.stride(1) == 1 and xq.dtype == wq.dtype == torch.int8
    out = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    return launch(_w8a8_gemm_kernel, M, N, K, BLOCK_K, TILES, out, split_k,
                  (xq, wq, x_scale, w_scale, bias if bias is not None else w_scale), (xq.stride(0), wq.stride(0)),
                  HAS_BIAS=bias is not None, BLOCK_K=BLOCK_K)
