"""Fused layer ops behind one interface: torch references (CPU) or Triton kernels.

The same choice as the attention backend: `attention_backend="triton"` runs every
kernel of the layer in Triton (one launch per op), "torch" runs the references.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class LayerOps:
    add_rms_norm: Callable      # (x, residual | None, weight, eps) -> (normed, new residual)
    rotary: Callable            # (positions, q, k, cos, sin, q_norm, k_norm, eps) -> (q, k)
    act_and_mul: Callable       # ([T, 2I] gate|up, activation name) -> [T, I]
    # (x, w13 [E, 2I, H], w2 [E, H, I], topk_weights, topk_ids, act; biases, SwiGLU limits,
    # MXFP4 scales as keywords) -> [T, H] (moe_reference.py)
    fused_moe: Callable
    # ([T, E] router logits, top_k, renormalize; softmax_after_topk) -> (weights fp32, ids) [T, k]
    moe_route: Callable
    backend: str = "torch"      # which set: a model keeps weights a kernel of this set can read


def make_layer_ops(backend: str) -> LayerOps:
    if backend == "triton":
        from backend.ops import triton_kernels as k
        from backend.ops.fused_moe_triton import fused_moe, route
    else:   # the references, with RMSNorm and rotary in C++ on the CPU where they build
        from backend.ops import cpu_layer_ops as k
        from backend.ops.moe_reference import fused_moe, route
    return LayerOps(k.add_rms_norm, k.rotary, k.act_and_mul, fused_moe=fused_moe, moe_route=route,
                    backend="triton" if backend == "triton" else "torch")
