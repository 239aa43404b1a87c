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


def make_layer_ops(backend: str) -> LayerOps:
    if backend == "triton":
        from backend.ops import triton_kernels as k
    else:
        from backend.ops import reference as k
    return LayerOps(k.add_rms_norm, k.rotary, k.act_and_mul)
