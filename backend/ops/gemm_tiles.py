"""The tile bookkeeping the GEMM kernels share (W4A16/W8A16, W8A8 INT8, block-wise FP8):
which [BLOCK_M, BLOCK_N] output tile a program owns, loading a K step of the activations
and of a row-major [N, K] weight as its [K, N] transpose, and storing the tile. Triton
inlines these into each kernel; out-of-range elements load as 0 and are not stored.

Split K (the weight-only and W8A8 GEMMs): at decode sizes (M of 1-16 rows) the output
tiles alone leave most SMs idle, so `launch` also splits K until the grid holds about
PROGRAMS_PER_SM programs per SM. Each split stores fp32 partials ([splits, M, N]) and
`_sum_splits_kernel` adds them in split order, so the result does not depend on which
program ran first. Tile sizes come per M bucket from each kernel's table.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

# Split K until the grid holds about this many programs per SM (two waves).
PROGRAMS_PER_SM = 2
# Off CUDA (the interpreter) a small count, so that CI's small shapes split too.
CPU_SMS = 4


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


@triton.jit
def store_result(out_ptr, acc, rows, cols, mask_m, mask_n, stride_om, stride_os):
    """The tile into the output, or into this split's fp32 partials ([splits, M, N])."""
    store_tile(out_ptr + tl.program_id(2).to(tl.int64) * stride_os, acc, rows, cols, mask_m, mask_n, stride_om)


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, N, stride_pm, stride_ps, stride_om, SPLITS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """out[m, :] = the sum of the splits' partials, in split order (deterministic)."""
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + s * stride_ps + m * stride_pm + cols, mask=mask, other=0.0)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def tile_config(M: int, tiles: tuple) -> tuple:
    """The row of `tiles` ((largest M, BLOCK_M, BLOCK_N, num_warps, num_stages), ...) for
    M rows, without its bound."""
    for row in tiles:
        if M <= row[0]:
            return row[1:]
    raise AssertionError("a tile table ends with an unbounded bucket")


def plan_splits(tiles: int, k_steps: int, num_sms: int, split_k: Optional[int] = None) -> tuple[int, int]:
    """(splits, K steps per split): enough programs for PROGRAMS_PER_SM on every SM, each
    split an equal whole number of K steps (split_k: a forced count, for tests and tuning)."""
    want = split_k if split_k else -(-PROGRAMS_PER_SM * num_sms // tiles)
    per = -(-k_steps // max(1, min(want, k_steps)))
    return -(-k_steps // per), per


def launch(kernel, M: int, N: int, K: int, block_k: int, tiles: tuple, out: torch.Tensor, split_k: Optional[int],
           inputs: tuple, scalars: tuple, **consts) -> torch.Tensor:
    """kernel[(M tiles, N tiles, splits)](*inputs, target, M, N, K, *scalars, stride_om,
    stride_os, K_PER_SPLIT, BLOCK_M, BLOCK_N, **consts): into `out` directly, or through
    fp32 partials summed into it. The kernel stores with store_result."""
    if M == 0 or N == 0:                # (an empty grid: nothing to launch or sum)
        return out
    block_m, block_n, warps, stages = tile_config(M, tiles)
    grid_tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    splits, steps = plan_splits(grid_tiles, triton.cdiv(K, block_k), _num_sms(out.device), split_k)
    target = out if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=out.device)
    stride_om, stride_os = (out.stride(0), 0) if splits == 1 else (N, M * N)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), splits)
    kernel[grid](*inputs, target, M, N, K, *scalars, stride_om, stride_os, steps * block_k, BLOCK_M=block_m,
                 BLOCK_N=block_n, num_warps=warps, num_stages=stages, **consts)
    if splits > 1:
        _sum_splits_kernel[(M, triton.cdiv(N, 1024))](target, out, N, N, M * N, out.stride(0), SPLITS=splits,
                                                       BLOCK=1024)
    return out
