"""W4A16 / W8A16 GEMM in OpenAI Triton: out = x @ dequant(W)^T with W packed as
backend/models/int_formats.py lays it out (int32 words along K, scales and zeros per
group of input rows, g_idx giving each row's group). bitsandbytes NF4/FP4 codes are
looked up in their 16-value table first. Two kernels:

- `int_gemm_blocked`, for the common checkpoints (no act order, groups of 128 4-bit or
  64 8-bit rows or a multiple, or one group per channel). The weights are re-packed once
  at load (`block_for_kernel`) so that a K step of BLOCK_K rows is 16 packed rows whose
  word bits j hold the contiguous rows j*16 .. j*16+15. Each word is then loaded once (16
  bytes per thread along N), its j-th codes meet a contiguous slice of x in one tensor-core
  dot, and the step's group scale and zero are applied once to the [BLOCK_M, BLOCK_N]
  result: sum_k x_k s (q_k - z) = s (sum_k x_k q_k - z sum_k x_k). 4-bit codes become
  16-bit floats by an or into the mantissa (128 + q in bf16, 1024 + q in fp16, both
  exact) with the offset folded into the zero, so no convert instruction runs per weight.
- `int_gemm`, for the rest (act order, small groups, NF4/FP4): codes, group scales and
  zeros gathered per weight row.

Both split K across programs when the output tiles alone would leave most SMs idle (a
decode step: M of 1-16 rows, N of 4-28k; backend/ops/gemm_tiles.launch). Tile sizes per
M bucket are in `TILES`: chosen from the roofline (the weight stream must keep about two
waves of programs busy at M <= 16), not yet measured on a GPU
(benchmarks/quant_kernel_bench.py times them against bf16 and the weight-read floor).
fp32 accumulation, one rounding to x's dtype at the end. The torch reference is
int_formats.dequantize + F.linear. With TRITON_INTERPRET=1 they run on CPU tensors (CI).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from backend.ops.gemm_tiles import launch, load_rows, output_tile, store_result

# (largest M, BLOCK_M, BLOCK_N, num_warps, num_stages). A blocked K step is always 16
# packed rows (BLOCK_K = 16 * 32 / bits): the smallest K a tensor-core dot takes.
TILES = ((16, 16, 64, 4, 4), (64, 64, 64, 4, 3), (1 << 62, 64, 128, 8, 3))
PACKED_ROWS = 16
@triton.jit
def _int_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, M, N, K, stride_xm, stride_qk, stride_sg,
                     stride_om, stride_os, K_PER_SPLIT, BITS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, lut_ptr=None, LUT: tl.constexpr = False,
                     IEEE: tl.constexpr = False):
    PER: tl.constexpr = 32 // BITS
    rows, cols, mask_m, mask_n = output_tile(M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = tl.program_id(2) * K_PER_SPLIT
    for k0 in range(k_lo, tl.minimum(k_lo + K_PER_SPLIT, K), BLOCK_K):
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
    store_result(out_ptr, acc, rows, cols, mask_m, mask_n, stride_om, stride_os)


@triton.jit
def _int_gemm_blocked_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_xm, stride_qk, stride_sg,
                             stride_om, stride_os, K_PER_SPLIT, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MAGIC: tl.constexpr,
                             OFFSET: tl.constexpr, IEEE: tl.constexpr):
    """Weights in block_for_kernel's layout; GROUP_SIZE 0: one group (per-channel scales).
    MAGIC (4-bit, 16-bit x): the float whose bits are MAGIC | q is OFFSET + q."""
    PER: tl.constexpr = 32 // BITS
    ROWS: tl.constexpr = 16                       # PACKED_ROWS: packed rows per K step
    BLOCK_K: tl.constexpr = ROWS * PER
    rows, cols, mask_m, mask_n = output_tile(M, N, BLOCK_M, BLOCK_N)
    r = tl.arange(0, ROWS)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = tl.program_id(2) * K_PER_SPLIT
    for k0 in range(k_lo, tl.minimum(k_lo + K_PER_SPLIT, K), BLOCK_K):
        words = tl.load(qw_ptr + (k0 // PER + r)[:, None].to(tl.int64) * stride_qk + cols[None, :],
                        mask=mask_n[None, :], other=0)
        step = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        x_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for j in tl.static_range(PER):          # word bits j: rows k0 + j*16 .. k0 + j*16 + 15
            xj = load_rows(x_ptr, rows, k0 + j * ROWS + r, mask_m, r < ROWS, stride_xm)
            q = (words >> (j * BITS)) & ((1 << BITS) - 1)
            if MAGIC:
                w = (q | MAGIC).to(tl.int16).to(xj.dtype, bitcast=True)
            else:
                w = q.to(xj.dtype)
            if IEEE:
                step = tl.dot(xj, w, step, input_precision="ieee")
            else:
                step = tl.dot(xj, w, step)
            x_sum += tl.sum(xj.to(tl.float32), axis=1)
        g = 0
        if GROUP_SIZE != 0:
            g = k0 // GROUP_SIZE
        scale = tl.load(s_ptr + g * stride_sg + cols, mask=mask_n, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + g * stride_sg + cols, mask=mask_n, other=0.0).to(tl.float32) + OFFSET
        acc += step * scale[None, :] - x_sum[:, None] * (zero * scale)[None, :]
    store_result(out_ptr, acc, rows, cols, mask_m, mask_n, stride_om, stride_os)


def int_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
             g_idx: torch.Tensor, bits: int, out: Optional[torch.Tensor] = None,
             quant_map: Optional[torch.Tensor] = None, split_k: Optional[int] = None) -> torch.Tensor:
    """x [M, K] -> [M, N], into `out` when given (a column slice of a fused output).
    qweight / scales / zeros may be column slices of the fused tensors too. quant_map
    (fp32 [16], bitsandbytes NF4/FP4): each code's value, w = quant_map[q] * scale, no zeros."""
    x = x.contiguous()
    M, K = x.shape
    N = qweight.shape[1]
    assert qweight.stride(1) == 1 and scales.stride(1) == 1
    assert quant_map is not None or scales.stride() == zeros.stride()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    return launch(_int_gemm_kernel, M, N, K, 64, TILES, out, split_k, (x, qweight, scales, zeros, g_idx),
                  (x.stride(0), qweight.stride(0), scales.stride(0)), BITS=bits, BLOCK_K=64, lut_ptr=quant_map,
                  LUT=quant_map is not None, IEEE=x.dtype == torch.float32)


def blocked_eligible(K: int, bits: int, group_size: int) -> bool:
    """Whether int_gemm_blocked runs these weights: whole K steps, each inside one group."""
    block_k = PACKED_ROWS * 32 // bits
    return K % block_k == 0 and (group_size == -1 or group_size % block_k == 0)


def block_for_kernel(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """int_formats' packing (word row R, bits j: row R*per + j) -> int_gemm_blocked's
    (in each K step of 16*per rows, word row r, bits j: row j*16 + r), on qweight's device."""
    per = 32 // bits
    rows, N = qweight.shape
    block_k = PACKED_ROWS * per
    steps = torch.arange(0, rows * per, block_k, device=qweight.device)
    r = torch.arange(PACKED_ROWS, device=qweight.device)
    mask = (1 << bits) - 1
    out = torch.zeros_like(qweight)
    for j in range(per):
        src = (steps[:, None] + j * PACKED_ROWS + r[None, :]).reshape(-1)          # the rows bits j take
        codes = (qweight[src // per] >> ((src % per) * bits).to(torch.int32)[:, None]) & mask
        out |= codes << (j * bits)
    return out


def int_gemm_blocked(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     bits: int, group_size: int, out: Optional[torch.Tensor] = None,
                     split_k: Optional[int] = None) -> torch.Tensor:
    """int_gemm for weights in block_for_kernel's layout (blocked_eligible; the groups
    run in order along K, group_size -1: per channel)."""
    x = x.contiguous()
    M, K = x.shape
    N = qweight.shape[1]
    assert blocked_eligible(K, bits, group_size), (K, bits, group_size)
    assert qweight.stride(1) == 1 and scales.stride(1) == 1 and scales.stride() == zeros.stride()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    magic, offset = 0, 0.0
    if bits == 4 and x.dtype in (torch.bfloat16, torch.float16):
        magic, offset = (0x4300, 128.0) if x.dtype == torch.bfloat16 else (0x6400, 1024.0)
    return launch(_int_gemm_blocked_kernel, M, N, K, PACKED_ROWS * 32 // bits, TILES, out, split_k,
                  (x, qweight, scales, zeros), (x.stride(0), qweight.stride(0), scales.stride(0)), BITS=bits,
                  GROUP_SIZE=0 if group_size == -1 else group_size, MAGIC=magic, OFFSET=offset,
                  IEEE=x.dtype == torch.float32)
