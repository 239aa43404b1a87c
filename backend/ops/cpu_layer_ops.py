"""The torch layer ops with their busiest fused in C++ on the CPU (cpu_layer_ops.cpp):
residual-add + RMSNorm, rotary and SiLU-and-mul, fp32. Anything else (another device or
dtype, Qwen3's q/k norms, partial rotary, other activations, odd layouts) runs the torch
reference.

Why: the reference RMSNorm is 7 torch ops and rotary 20 per layer, and every op takes
the GIL for its dispatch. With the forward split over threads (cpu_shards.py) the two
shard threads queued for it: a shard ran 15% slower beside a thread of small torch ops,
and the two shards together 30-40% slower than either alone (docs/archive/benchmarks.md section
16). One foreign call each (ctypes releases the GIL while it runs) cuts a shard's op
count by half. `PAGED_LLM_CPU_LAYER_OPS=0` keeps the references.
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch

from backend.ops import reference
from backend.ops.cpu_build import CppLibrary, heads_dense, plain_tensors, rows_f32

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_layer_ops.cpp")
ENV_SWITCH = "PAGED_LLM_CPU_LAYER_OPS"

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_LIBRARY = CppLibrary(SOURCE, ENV_SWITCH, {
    "add_rms_norm_f32": (None, [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, ctypes.c_float, _ptr, _i64, _ptr, _i64]),
    "rotary_f32": (ctypes.c_int, [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64,
                                  _ptr, _ptr]),
    "silu_and_mul_f32": (None, [_ptr, _i64, _i64, _i64, _ptr, _i64]),
}, "CPU layer ops")


def library() -> Optional[ctypes.CDLL]:
    return _LIBRARY.get()


def add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual); with no residual, (RMSNorm(x), x)."""
    # (the cheap checks first: a run on another device never builds the library)
    if (not rows_f32(x) or (residual is not None and (not rows_f32(residual) or residual.shape != x.shape))
            or weight.dtype != torch.float32 or weight.device.type != "cpu" or not weight.is_contiguous()
            or weight.shape != x.shape[-1:] or not plain_tensors(x, weight, *([residual] if residual is not None else []))
            or (lib := library()) is None):
        return reference.add_rms_norm(x, residual, weight, eps)
    T, N = x.shape
    out = torch.empty((T, N), dtype=x.dtype)
    res = torch.empty((T, N), dtype=x.dtype) if residual is not None else x
    lib.add_rms_norm_f32(x.data_ptr(), x.stride(0), residual.data_ptr() if residual is not None else None,
                         residual.stride(0) if residual is not None else 0, weight.data_ptr(), T, N, eps,
                         out.data_ptr(), N, res.data_ptr() if residual is not None else None, N)
    return out, res


def _heads_f32(x: torch.Tensor) -> bool:
    """[T, heads, D] fp32 on the CPU, heads D apart (a view of the qkv GEMM's rows)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and heads_dense(x)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
           sin_cache: torch.Tensor, q_norm: Optional[torch.Tensor] = None, k_norm: Optional[torch.Tensor] = None,
           eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """As reference.rotary: returns new tensors."""
    D = q.shape[-1]
    if (q_norm is not None or not _heads_f32(q) or not _heads_f32(k) or D % 2 or k.shape[-1] != D
            or k.shape[0] != q.shape[0] or positions.shape != q.shape[:1]
            or positions.dtype not in (torch.int32, torch.int64) or not positions.is_contiguous()
            or positions.device.type != "cpu" or cos_cache.shape[-1] != D or sin_cache.shape != cos_cache.shape
            or any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()
                   for t in (cos_cache, sin_cache))
            or not plain_tensors(positions, q, k, cos_cache, sin_cache) or (lib := library()) is None):
        return reference.rotary(positions, q, k, cos_cache, sin_cache, q_norm, k_norm, eps)
    T, H, _ = q.shape
    q_out = torch.empty((T, H, D), dtype=q.dtype)
    k_out = torch.empty((T, k.shape[1], D), dtype=k.dtype)
    if lib.rotary_f32(positions.data_ptr(), positions.element_size(), T, q.data_ptr(), q.stride(0), H,
                      k.data_ptr(), k.stride(0), k.shape[1], D, cos_cache.data_ptr(), sin_cache.data_ptr(),
                      cos_cache.shape[0], q_out.data_ptr(), k_out.data_ptr()):
        raise IndexError(f"a position lies outside the rotary tables' {cos_cache.shape[0]} rows")
    return q_out, k_out


def act_and_mul(x: torch.Tensor, act: str) -> torch.Tensor:
    """As reference.act_and_mul; SiLU in one pass over [gate | up] ([T, 2I] fp32 rows),
    on up to torch's intra-op thread count. torch's silu and product were 4% of the
    hidden-1024 Llama's CPU time (218 ms of a 5.5 s job: two passes and a temporary);
    vLLM fuses them as well. Within a few ulp of torch's (its exp, cpu_vec.h)."""
    if (act != "silu" or not rows_f32(x) or x.shape[-1] % 2 or x.requires_grad or not plain_tensors(x)
            or (lib := library()) is None):
        return reference.act_and_mul(x, act)
    T, I = x.shape[0], x.shape[1] // 2
    out = torch.empty((T, I), dtype=x.dtype)
    lib.silu_and_mul_f32(x.data_ptr(), x.stride(0), T, I, out.data_ptr(), torch.get_num_threads())
    return out

