"""The fused layer ops in OpenAI Triton, one launch each (torch references in
reference.py; same arguments, same results in fp32 up to summation order).

- add_rms_norm: residual add and RMSNorm in one pass; returns the normed rows and the
  new residual.
- rotary: RoPE on q and k in place (they are views into the fused qkv output), with
  Qwen3's per-head q/k RMSNorm folded into the same pass.
- act_and_mul: SiLU(gate) * up over the fused gate_up output.

With TRITON_INTERPRET=1 they run on CPU tensors, which is how CI checks them. Products
and sums are fp32; each result is rounded once to the activation dtype at the point
where Hugging Face's modules round it.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from backend.ops import reference


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro,
                         N, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, WEIGHT_FIRST: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # The add rounds to the activation dtype, as `residual + x` does in the model.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    y = xf * tl.math.rsqrt(var + eps)
    if not WEIGHT_FIRST:        # (fp32 weights on narrower activations multiply unrounded)
        y = y.to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    T, N = x.shape
    out = torch.empty_like(x)
    if residual is None:
        res_out, res_in = x, x
    else:
        res_out, res_in = torch.empty_like(x), residual
    if T:
        _add_rms_norm_kernel[(T,)](x, res_in, weight, out, res_out, x.stride(0), res_in.stride(0), out.stride(0),
                                   res_out.stride(0), N, eps, HAS_RESIDUAL=residual is not None,
                                   BLOCK=triton.next_power_of_2(N),
                                   WEIGHT_FIRST=weight.dtype == torch.float32 and x.dtype != torch.float32)
    return out, res_out


@triton.jit
def _rotate_heads(base, stride_h, num_heads, c, s, i, w_ptr, eps, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  QK_NORM: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    mask = (h[:, None] < num_heads) & (i[None, :] < HALF)
    p1 = base + h[:, None] * stride_h + i[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if QK_NORM:
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        r = tl.math.rsqrt(var + eps)[:, None]
        w1 = tl.load(w_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(p1, (x1 * c - x2 * s).to(dtype), mask=mask)
    tl.store(p1 + HALF, (x2 * c + x1 * s).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, stride_qt, stride_qh, stride_kt,
                   stride_kh, stride_cos, eps, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                   HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                   QK_NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    # cos/sin rows are [freqs, freqs]: the first half is the whole table. Rounded to the
    # activation dtype first, as the model does.
    dtype = q_ptr.dtype.element_ty
    c = tl.load(cos_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0).to(dtype).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0).to(dtype).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, NUM_HEADS, c, s, i, qw_ptr, eps, HALF, BLOCK_HQ, QK_NORM)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, NUM_KV_HEADS, c, s, i, kw_ptr, eps, HALF, BLOCK_HK, QK_NORM)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
           sin_cache: torch.Tensor, q_norm: Optional[torch.Tensor] = None, k_norm: Optional[torch.Tensor] = None,
           eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q [T, H, D] and k [T, KVH, D] (strided views are fine; the last dim
    must be contiguous). Tables narrower than D (partial_rotary_factor) rotate the first
    channels only: the kernel's pair distance is half the table's width. Returns (q, k)."""
    T, H, D = q.shape
    rd = cos_cache.shape[-1]
    if rd < D and q_norm is not None:
        raise ValueError("partial RoPE with q/k norms is not supported")
    if T:
        qk_norm = q_norm is not None
        _rotary_kernel[(T,)](q, k, positions, cos_cache, sin_cache, q_norm if qk_norm else q,
                             k_norm if qk_norm else k, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                             cos_cache.stride(0), eps, NUM_HEADS=H, NUM_KV_HEADS=k.shape[1], HALF=rd // 2,
                             BLOCK_HALF=triton.next_power_of_2(rd // 2), BLOCK_HQ=triton.next_power_of_2(H),
                             BLOCK_HK=triton.next_power_of_2(k.shape[1]), QK_NORM=qk_norm)
    return q, k


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def act_and_mul(x: torch.Tensor, act: str) -> torch.Tensor:
    if act != "silu":
        return reference.act_and_mul(x, act)
    T, N2 = x.shape
    N = N2 // 2
    out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if T:
        block = min(triton.next_power_of_2(N), 1024)
        _silu_and_mul_kernel[(T, triton.cdiv(N, block))](x, out, x.stride(0), out.stride(0), N, BLOCK=block)
    return out
