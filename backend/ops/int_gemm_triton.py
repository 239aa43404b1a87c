"""W4A16 / W8A16 GEMM in OpenAI Triton: out = x @ dequant(W)^T with W packed as
backend/models/int_formats.py lays it out (int32 words along K, scales and zeros per
group of input rows, g_idx giving each row's group, so act-order checkpoints need no
reordering). bitsandbytes NF4/FP4 codes are looked up in their 16-value table first.

Each program computes a [BLOCK_M, BLOCK_N] tile: per K step it loads the packed words of
BLOCK_K rows, shifts and masks out the values, looks up each row's group scale and zero,
and forms the fp tile in registers before tl.dot; the weights cross memory packed. fp32
accumulation, one rounding to x's dtype at the end. The torch reference is
int_formats.dequantize + F.linear. With TRITON_INTERPRET=1 it runs on CPU tensors (CI).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from backend.ops.gemm_tiles import load_rows, output_tile, store_tile


@triton.jit
def _int_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, M, N, K, stride_xm, stride_qk, stride_sg,
                     stride_om, BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, lut_ptr=None, LUT: tl.constexpr = False, IEEE: tl.constexpr = False):
    PER: tl.constexpr = 32 // BITS
    rows, cols, mask_m, mask_n = output_tile(M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask_k = ks < K
        xt = load_rows(x_ptr, rows, ks, mask_m, mask_k, stride_xm)
        wmask = mask_k[:, None] & mask_n[None, :]
        words = tl.load(qw_ptr + (ks // PER)[:, None] * stride_qk + cols[None, :], mask=wmask, other=0)
        q = (words >> ((ks % PER) * BITS)[:, None]) & ((1 << BITS) - 1)
        g = tl.load(g_ptr + ks, mask=mask_k, other=0)
        scale = tl.load(s_ptr + g[:, None] * stride_sg + cols[None, :], mask=wmask, other=0.0).to(tl.float32)
        if LUT:         # NF4/FP4: the code's value from the 16-entry table (cached, 64 bytes); no zero
            w = (tl.load(lut_ptr + q, mask=wmask, other=0.0) * scale).to(xt.dtype)
        else:
            zero = tl.load(z_ptr + g[:, None] * stride_sg + cols[None, :], mask=wmask, other=0.0).to(tl.float32)
            w = ((q.to(tl.float32) - zero) * scale).to(xt.dtype)
        if IEEE:    # fp32 operands: full fp32 products, as torch's fp32 matmul (Triton's default is TF32)
            acc += tl.dot(xt, w, input_precision="ieee")
        else:       # 16-bit operands are exact in TF32: tensor cores lose nothing
            acc += tl.dot(xt, w)
    store_tile(out_ptr, acc, rows, cols, mask_m, mask_n, stride_om)


def int_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
             g_idx: torch.Tensor, bits: int, out: Optional[torch.Tensor] = None,
             quant_map: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] -> [M, N], into `out` when given (a column slice of a fused output).
    qweight / scales / zeros may be column slices of the fused tensors too. quant_map
    (fp32 [16], bitsandbytes NF4/FP4): each code's value, w = quant_map[q] * scale, no zeros."""
    x = x.contiguous()
    M, K = x.shape
    N = qweight.shape[1]
    assert qweight.stride(1) == 1 and scales.stride(1) == 1
    assert quant_map is not None or scales.stride() == zeros.stride()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    block_m = 16 if M <= 16 else 64
    block_n, block_k = 64, 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _int_gemm_kernel[grid](x, qweight, scales, zeros, g_idx, out, M, N, K, x.stride(0), qweight.stride(0),
                           scales.stride(0), out.stride(0), BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n,
                           BLOCK_K=block_k, lut_ptr=quant_map, LUT=quant_map is not None,
                           IEEE=x.dtype == torch.float32)
    return out
