"""The tile bookkeeping the GEMM kernels share (W4A16/W8A16, W8A8 INT8, block-wise FP8):
which [BLOCK_M, BLOCK_N] output tile a program owns, loading a K step of the activations
and of a row-major [N, K] weight as its [K, N] transpose, and storing the tile. Triton
inlines these into each kernel; out-of-range elements load as 0 and are not stored."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def output_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(rows, cols, row mask, column mask) of the program's output tile (grid: M tiles, N tiles)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols, rows < M, cols < N


@triton.jit
def load_rows(ptr, rows, ks, mask_m, mask_k, stride):
    """[BLOCK_M, BLOCK_K] of a row-major [M, K] matrix at rows x ks."""
    return tl.load(ptr + rows[:, None].to(tl.int64) * stride + ks[None, :],
                   mask=mask_m[:, None] & mask_k[None, :], other=0.0)


@triton.jit
def load_transposed(ptr, cols, ks, mask_n, mask_k, stride):
    """[BLOCK_K, BLOCK_N] of W^T for a row-major weight W [N, K] at ks x cols."""
    return tl.load(ptr + cols[None, :].to(tl.int64) * stride + ks[:, None],
                   mask=mask_k[:, None] & mask_n[None, :], other=0.0)


@triton.jit
def store_tile(out_ptr, tile, rows, cols, mask_m, mask_n, stride):
    """The tile, rounded once to the output's dtype, into a row-major [M, N] output."""
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride + cols[None, :], tile.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])
