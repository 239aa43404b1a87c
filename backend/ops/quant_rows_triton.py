"""Dynamic activation quantization in one launch (OpenAI Triton): each token's row, or each
group of a row's channels, scaled by its max |x| and rounded to INT8 or FP8 E4M3.

The torch references (backend/models/w8a8.quantize_per_token, backend/models/fp8's
per-token scales, backend/ops/fp8_quant.quantize_per_group) take six to eight kernels and
as many passes over x; at a W8A8 or FP8 GEMM's M of 256 those launches cost about as much
as the GEMM. Here one program reads its row (or group) twice, the second time from
cache: the max, then the rounding. The results equal the references bit for bit: the
same fp32 division, INT8 rounding half to even (torch.round's) by the 1.5 * 2^23 trick,
FP8 by the hardware's round-to-nearest-even convert after the same clamp. With
TRITON_INTERPRET=1 it runs on CPU tensors (CI).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from backend.ops.fp8_quant import FP8_MAX

INT8_MAX = 127.0
ROUND_HALF_EVEN = tl.constexpr(12582912.0)       # 1.5 * 2^23: x + it - it rounds |x| < 2^22 to the nearest even integer


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, stride_s, GROUP: tl.constexpr,
                       BLOCK: tl.constexpr, FP8: tl.constexpr, STATIC: tl.constexpr, MIN_AMAX: tl.constexpr,
                       QMAX: tl.constexpr):
    """Program (row, group): channels [group * GROUP, min(K, (group + 1) * GROUP)).
    STATIC: the scale is read from s_ptr[0] (FP8's calibrated per-tensor scale)."""
    row = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * GROUP
    hi = tl.minimum(lo + GROUP, K)
    if STATIC:
        scale = tl.load(s_ptr)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(lo, hi, BLOCK):
            ks = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + ks, mask=ks < hi, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), MIN_AMAX), QMAX)
        tl.store(s_ptr + row * stride_s + tl.program_id(1), scale)
    for k0 in range(lo, hi, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        mask = ks < hi
        # IEEE division, as torch's (Triton's `/` compiles to the approximate div.full.f32).
        v = tl.math.div_rn(tl.load(x_ptr + row * stride_x + ks, mask=mask, other=0.0).to(tl.float32), scale)
        if FP8:
            q = tl.clamp(v, -QMAX, QMAX).to(q_ptr.dtype.element_ty)
        else:
            q = tl.clamp((v + ROUND_HALF_EVEN) - ROUND_HALF_EVEN, -128.0, 127.0).to(tl.int8)
        tl.store(q_ptr + row * stride_q + ks, q, mask=mask)


def quantize_rows(x: torch.Tensor, fp8: bool, group: Optional[int] = None,
                  static_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (INT8 or E4M3 [M, K], fp32 scales [M] per token, or [M, ceil(K/group)]
    per group); static_scale (a 0-d or 1-element fp32 tensor, FP8 only): that scale for
    every row, returned as given."""
    assert x.dim() == 2 and x.stride(1) == 1 and (static_scale is None or fp8)
    M, K = x.shape
    groups = 1 if group is None else triton.cdiv(K, group)
    width = K if group is None else group
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn if fp8 else torch.int8, device=x.device)
    if static_scale is not None:
        scales = static_scale.reshape(1).to(torch.float32)
    else:
        scales = torch.empty(M, groups, dtype=torch.float32, device=x.device)
    if M:
        block = min(triton.next_power_of_2(width), 2048)
        _quant_rows_kernel[(M, groups)](x, q, scales, K, x.stride(0), q.stride(0), scales.stride(0), GROUP=width,
                                        BLOCK=block, FP8=fp8, STATIC=static_scale is not None,
                                        MIN_AMAX=1e-12 if fp8 else 1e-10, QMAX=FP8_MAX if fp8 else INT8_MAX)
    if static_scale is not None:
        return q, static_scale
    return q, scales if group is not None else scales.reshape(M)
