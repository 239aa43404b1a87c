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

The experts stay FP8 in memory ([E, 2I, H] and [E, H, I] float8_e4m3fn with their fp32
scales): on CUDA the fused MoE Triton kernel dequantizes each weight tile in registers
(fp8 * scale, rounded to the compute dtype); the torch reference (CPU) dequantizes the
stacks the same way on each call, exactly. Tensor parallelism of FP8 MoE builds is
refused: the shard reader slices the per-expert checkpoint tensors, not these stacked
ones.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from backend.models.fp8 import FP8_MAX, QUANT_METHOD

EXPERT_WEIGHTS = ("experts.gate_up_proj", "experts.down_proj")
SCALE_SUFFIX = "_weight_scale"


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] -> (fp8 [E, N, K], fp32 scale [E, N]) with w ~= fp8 * scale[..., None]."""
    scale = w.float().abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    q = (w.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def is_fp8_moe(quant: Optional[dict[str, Any]], moe: object) -> bool:
    return moe is not None and bool(quant) and quant.get("quant_method") == QUANT_METHOD


def swap_in_fp8_experts(model: nn.Module) -> None:
    """Every StackedExperts of the (meta) model holds FP8 stacks and fp32 scales
    (`gate_up_proj_scale` [E, 2I], `down_proj_scale` [E, H]), which SparseMoeBlock hands
    to LayerOps.fused_moe; `quantized` keeps the loader from casting them."""
    from backend.models.moe import StackedExperts
    for module in model.modules():
        if not isinstance(module, StackedExperts):
            continue
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(module, name)
            setattr(module, name, nn.Parameter(torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device),
                                               requires_grad=False))
            setattr(module, f"{name}_scale", nn.Parameter(torch.empty(w.shape[:2], device=w.device),
                                                          requires_grad=False))
        module.quantized = True


def fp8_experts_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's FP8 expert stacks' scales under the engine's names (in place),
    their shapes checked."""
    for name in [k for k in state if k.endswith(EXPERT_WEIGHTS)]:
        w = state[name]
        if w.dtype != torch.float8_e4m3fn:
            raise ValueError(f"FP8 mixture-of-experts checkpoint: '{name}' is {w.dtype}, not float8_e4m3fn")
        scale = state.pop(name + SCALE_SUFFIX, None)
        if scale is None or tuple(scale.shape) != tuple(w.shape[:2]):
            raise ValueError(f"FP8 mixture-of-experts checkpoint: '{name}{SCALE_SUFFIX}' should be "
                             f"{list(w.shape[:2])}, got {None if scale is None else list(scale.shape)}")
        state[name + "_scale"] = scale.float()
    return state
