"""Mixture-of-experts routing and the torch reference of the fused MoE kernel.

- route: softmax over the router logits in fp32, top-k, optional renormalization of the
  k probabilities (Mixtral always; Qwen-MoE with `norm_topk_prob`), in one function that
  both backends share (it is a few element-wise ops on [T, E]).
- fused_moe: what the Triton kernel (fused_moe_triton.py) computes, expert by expert:
  each (token, k) slot gets its expert's down(act(gate) * up) of the token, scaled by
  its routing weight; a token's k slots are summed in slot order. That is transformers'
  grouped experts path (the default in transformers 5) operation for operation, so fp32
  results match it bit for bit. The per-expert loop reads which experts have tokens on
  the host: this is the CPU path; on a GPU the Triton kernel runs.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from backend.ops.fp8_quant import dequantize_experts
from backend.ops.reference import act_and_mul


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          softmax_after_topk: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, k] fp32, expert ids [T, k] int64), best first.
    softmax_after_topk (gpt-oss): top-k of the logits, then a softmax over those k."""
    if softmax_after_topk:
        values, ids = torch.topk(router_logits.float(), top_k, dim=-1)
        return torch.softmax(values, dim=-1), ids
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def swiglu_oai(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU over x = [gate | up] ([T, 2I] -> [T, I]), in the order of
    transformers' GptOssExperts._apply_gate: gate clamped above, up on both sides,
    (up + 1) * gate * sigmoid(alpha * gate)."""
    half = x.shape[-1] // 2
    gate = x[..., :half].clamp(min=None, max=limit)
    up = x[..., half:].clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, act: str = "silu", b13: Optional[torch.Tensor] = None,
              b2: Optional[torch.Tensor] = None, alpha: float = 1.702, limit: float = 7.0,
              w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I];
    topk_weights / topk_ids [T, k]; ids outside [0, E) (another rank's experts under
    expert parallelism) contribute nothing. Optional biases b13 [E, 2I] and b2 [E, H]
    are added after each GEMM (as transformers' grouped path adds them); act "swigluoai"
    is gpt-oss's clamped SwiGLU with alpha / limit. With w13_scale / w2_scale the weights
    are MXFP4 (packed bytes [E, rows, in / 2], E8M0 scales [E, rows, in / 32]), or FP8
    E4M3 (w13 / w2 float8_e4m3fn, fp32 scales [E, rows] per expert and output channel),
    dequantized here. Returns [T, H] in x's dtype."""
    if w13.dtype == torch.float8_e4m3fn:
        w13, w2 = dequantize_experts(w13, w13_scale).to(x.dtype), dequantize_experts(w2, w2_scale).to(x.dtype)
    elif w13_scale is not None:
        w13, w2 = unpack_mxfp4(w13, w13_scale, x.dtype), unpack_mxfp4(w2, w2_scale, x.dtype)
    T, K = topk_ids.shape
    slots = torch.zeros(T, K, x.shape[1], dtype=x.dtype, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        if not 0 <= e < w13.shape[0]:
            continue
        tok, k = torch.where(topk_ids == e)
        gate_up = F.linear(x[tok], w13[e])
        if b13 is not None:
            gate_up = gate_up + b13[e]
        h = swiglu_oai(gate_up, alpha, limit) if act == "swigluoai" else act_and_mul(gate_up, act)
        down = F.linear(h, w2[e])
        slots[tok, k] = down if b2 is None else down + b2[e]
    return (slots * topk_weights[..., None].to(x.dtype)).sum(dim=1)


def unpack_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[E, rows, in / 2] bytes and [E, rows, in / 32] scales -> [E, rows, in] in dtype."""
    from backend.ops import mxfp4
    return mxfp4.dequantize(packed.view(*scales.shape, 16), scales, dtype)
