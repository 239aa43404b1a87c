"""FP8 (E4M3) experts of mixture-of-experts checkpoints built by `python -m builder build
--weights fp8` (Mixtral, Qwen2-MoE, Qwen3-MoE).

Checkpoint format: the builder writes the experts as transformers holds them, stacked per
layer: `model.layers.<i>.mlp.experts.gate_up_proj` float8_e4m3fn [E, 2I, H] (gate rows
then up rows) and `...experts.down_proj` [E, H, I], each with a per-expert, per-output-
channel fp32 scale `..._weight_scale` ([E, 2I], [E, H]; vLLM's Fp8MoEMethod keeps the
same per-expert w13 / w2 weight scales, per tensor or per channel): w = fp8 * scale.

Numerics: the experts are weight-only FP8 (W8A16): their activations are not rounded
(there is no static expert input scale to calibrate per expert, and the grouped GEMMs
take the compute dtype). The router (`gate`), the shared expert and its gate stay in the
source dtype (they are small, and the router's top-k decides which experts run). The
attention projections and the dense MLPs (Qwen3-MoE's mlp_only_layers) are FP8Linear as
in dense FP8 builds.

At load the experts are dequantized exactly (fp32 multiply, then the compute dtype): on
CPU this is the reference path; on CUDA the fused MoE Triton kernel then reads bf16
experts, so GPU memory holds the experts in the compute dtype (the checkpoint is what is
halved). Tensor parallelism of FP8 MoE builds is refused: the shard reader slices
the per-expert checkpoint tensors, not these stacked ones.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from backend.models.fp8 import FP8_MAX, QUANT_METHOD

EXPERT_WEIGHTS = ("experts.gate_up_proj", "experts.down_proj")
SCALE_SUFFIX = "_weight_scale"


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] -> (fp8 [E, N, K], fp32 scale [E, N]) with w ~= fp8 * scale[..., None]."""
    scale = w.float().abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    q = (w.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_experts(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The exact fp32 value of an FP8 expert stack: fp8 * scale per expert and channel."""
    return q.float() * scale.float()[..., None]


def is_fp8_moe(quant: Optional[dict[str, Any]], moe: object) -> bool:
    return moe is not None and bool(quant) and quant.get("quant_method") == QUANT_METHOD


def dequantize_fp8_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace every FP8 expert stack of a state dict and its scale by the fp32
    dequantized stack (in place); the loader casts it to the compute dtype."""
    for name in [k for k in state if k.endswith(EXPERT_WEIGHTS)]:
        w = state[name]
        if w.dtype != torch.float8_e4m3fn:
            continue
        scale = state.pop(name + SCALE_SUFFIX, None)
        if scale is None or tuple(scale.shape) != tuple(w.shape[:2]):
            raise ValueError(f"FP8 mixture-of-experts checkpoint: '{name}{SCALE_SUFFIX}' should be "
                             f"{list(w.shape[:2])}, got {None if scale is None else list(scale.shape)}")
        state[name] = dequantize_experts(w, scale)
    return state
