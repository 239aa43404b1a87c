"""SGMV shrink/expand in OpenAI Triton (the torch reference and the layout are in
backend/lora/punica.py; same arguments, same results up to summation order).

One kernel serves both: program (m, n, s) takes row tile m of slot s's rows (gathered
through sorted_rows), multiplies it by column tile n of W[s]^T over K in BLOCK_K steps
with fp32 accumulation, and either stores the tile (shrink) or adds scaling[s] times it
to the output (expand). Each output row belongs to exactly one slot, so no atomics. The
grid is sized from the step's largest group; tiles past a smaller group's rows return.

With TRITON_INTERPRET=1 it runs on CPU tensors, which is how CI checks it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:      # (annotations only: punica.py picks these kernels)
    from backend.lora.punica import LoRAMetadata


@triton.jit
def _sgmv_kernel(x_ptr, w_ptr, out_ptr, rows_ptr, starts_ptr, scaling_ptr, N, K,
                 stride_x, stride_ws, stride_wn, stride_o,
                 ADD: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
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
            add: bool) -> None:
    S, N, K = w.shape
    assert x.stride(1) == 1 and w.stride(2) == 1 and out.stride(1) == 1
    block_m = 16
    block_n = max(16, min(64, triton.next_power_of_2(N)))
    block_k = max(16, min(64, triton.next_power_of_2(K)))
    grid = (triton.cdiv(meta.max_rows_per_slot, block_m), triton.cdiv(N, block_n), S)
    _sgmv_kernel[grid](x, w, out, meta.sorted_rows, meta.slot_starts, scaling, N, K,
                       x.stride(0), w.stride(0), w.stride(1), out.stride(0),
                       ADD=add, IEEE=torch.float32 in (x.dtype, w.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def shrink(x: torch.Tensor, a: torch.Tensor, meta: LoRAMetadata, out: torch.Tensor) -> None:
    _launch(x, a, meta, out, meta.slot_starts, add=False)      # scaling unread


def expand(y: torch.Tensor, b: torch.Tensor, meta: LoRAMetadata, out: torch.Tensor,
           scaling: torch.Tensor, scaling_cpu: list[float]) -> None:
    _launch(y, b, meta, out, scaling, add=True)
