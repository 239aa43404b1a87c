"""SGMV shrink/expand in OpenAI Triton (the torch reference and the layout are in
backend/lora/punica.py; same arguments, same results up to summation order).

One kernel serves both: program (m, n, s) takes row tile m of slot s's rows (gathered
through sorted_rows), multiplies it by column tile n of W[s]^T over K in BLOCK_K steps
with fp32 accumulation, and either stores the tile (shrink) or adds scaling[s] times it
to the output (expand). Each output row belongs to exactly one slot, so no atomics. The
grid is sized from the step's largest group; tiles past a smaller group's rows return.

A fused projection's slices (q, k, v of qkv_proj; gate, up) expand in one launch: y holds
each slice's R columns side by side, and column c of the output, in slice i, reads only
y's columns [i R, (i + 1) R) (B's other entries load as zeros). One launch instead of one
per slice: fewer kernels per layer, where a decode step's LoRA cost is mostly their count.

With TRITON_INTERPRET=1 it runs on CPU tensors, which is how CI checks it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
import triton
import triton.language as tl

if TYPE_CHECKING:      # (annotations only: punica.py picks these kernels)
    from backend.lora.punica import LoRAMetadata


@triton.jit
def _sgmv_kernel(x_ptr, w_ptr, out_ptr, rows_ptr, starts_ptr, scaling_ptr, N, K,
                 stride_x, stride_ws, stride_wn, stride_o, SLICE1, SLICE2,
                 ADD: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, NUM_SLICES: tl.constexpr = 1, RANK: tl.constexpr = 1):
    """NUM_SLICES > 1 (expand): output columns from SLICE1 on belong to the second slice,
    from SLICE2 on to the third; W is [S, N, RANK] and column c of slice i takes x's
    columns [i RANK, (i + 1) RANK)."""
    m = tl.program_id(0)
    n = tl.program_id(1)
    s = tl.program_id(2)
    start = tl.load(starts_ptr + s)
    end = tl.load(starts_ptr + s + 1)
    first = start + m * BLOCK_M
    if first < end:
        idx = first + tl.arange(0, BLOCK_M)
        mask_m = idx < end
        rows = tl.load(rows_ptr + idx, mask=mask_m, other=0).to(tl.int64)
        cols = n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_base = w_ptr + s.to(tl.int64) * stride_ws
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            mask_k = ks < K
            xt = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :],
                         mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            if NUM_SLICES > 1:
                col_slice = (cols >= SLICE1).to(tl.int32) + (cols >= SLICE2).to(tl.int32)
                wt = tl.load(w_base + cols[None, :] * stride_wn + (ks % RANK)[:, None],
                             mask=mask_k[:, None] & mask_n[None, :] & ((ks // RANK)[:, None] == col_slice[None, :]),
                             other=0.0)
            else:
                wt = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None],
                             mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if IEEE:    # fp32 operands: full fp32 products, as torch's fp32 matmul (TF32 off by default)
                acc += tl.dot(xt.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
            else:       # 16-bit operands are exact in TF32: tensor cores lose nothing
                acc += tl.dot(xt.to(tl.float32), wt.to(tl.float32))
        ptrs = out_ptr + rows[:, None] * stride_o + cols[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        if ADD:
            scale = tl.load(scaling_ptr + s)
            prev = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            acc = prev + acc * scale
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, w: torch.Tensor, meta: LoRAMetadata, out: torch.Tensor, scaling: torch.Tensor,
            add: bool, slice_sizes: Optional[list[int]] = None) -> None:
    S, N, K = w.shape
    assert x.stride(1) == 1 and w.stride(2) == 1 and out.stride(1) == 1
    slices = dict(NUM_SLICES=1)
    bounds = [N, N]                 # where the second and third slices start (none: N)
    if slice_sizes is not None and len(slice_sizes) > 1:
        assert len(slice_sizes) <= 3 and sum(slice_sizes) == N
        bounds[:len(slice_sizes) - 1] = np.cumsum(slice_sizes[:-1]).tolist()
        slices = dict(NUM_SLICES=len(slice_sizes), RANK=K)
        K = K * len(slice_sizes)    # the reduction runs over every slice's rank columns of x
    block_m = 16
    block_n = max(16, min(64, triton.next_power_of_2(N)))
    block_k = max(16, min(64, triton.next_power_of_2(K)))
    grid = (triton.cdiv(meta.max_rows_per_slot, block_m), triton.cdiv(N, block_n), S)
    _sgmv_kernel[grid](x, w, out, meta.sorted_rows, meta.slot_starts, scaling, N, K,
                       x.stride(0), w.stride(0), w.stride(1), out.stride(0), *bounds,
                       ADD=add, IEEE=torch.float32 in (x.dtype, w.dtype), BLOCK_M=block_m, BLOCK_N=block_n,
                       BLOCK_K=block_k, **slices)


def shrink(x: torch.Tensor, a: torch.Tensor, meta: LoRAMetadata, out: torch.Tensor) -> None:
    _launch(x, a, meta, out, meta.slot_starts, add=False)      # scaling unread


def expand(y: torch.Tensor, b: torch.Tensor, meta: LoRAMetadata, out: torch.Tensor,
           scaling: torch.Tensor, scaling_cpu: list[float], slice_sizes: Optional[list[int]] = None) -> None:
    """Every slice of a fused projection in one launch (see the module's docstring)."""
    _launch(y, b, meta, out, scaling, add=True, slice_sizes=slice_sizes)
