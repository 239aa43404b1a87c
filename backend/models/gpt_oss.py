"""gpt-oss (transformers' GptOssForCausalLM) over the Llama-style decoder with MoE layers.

What it adds, each where the rest of the engine keeps it:
- Attention sinks: `self_attn.sinks` [num_heads], one learned logit per head in every
  softmax's denominator (llama.Attention passes it to the attention backends).
- Alternating sliding-window / full layers (layer_types; arch_config.sliding_windows),
  YaRN RoPE (rotary.yarn_frequencies), biases on q/k/v/o (config.attention_bias).
- Every MLP is a MoE (moe.SparseMoeBlock with MoEConfig's gpt-oss switches): a biased
  router, softmax over the top-k logits, experts with biases and the clamped SwiGLU.

The checkpoint stores each layer's experts stacked and transposed
(`mlp.experts.gate_up_proj` [E, H, 2I] with gate and up columns interleaved,
`down_proj` [E, I, H], biases [E, 2I] and [E, H]), or as published in MXFP4
(`*_blocks` / `*_scales` in [E, out, in] orientation, backend/ops/mxfp4.py).
adapt_checkpoint turns either into the engine's [E, 2I, H] (gate rows, then up rows)
and [E, H, I], and renames `mlp.router` to `mlp.gate`. MXFP4 experts are dequantized
there, unless the Triton fused MoE kernel runs (attention_backend="triton"): then they
stay packed (`[E, rows, in / 2]` bytes and `[E, rows, in / 32]` scales, rows reordered
the same way) and the kernel decodes them in its tiles, a quarter of the bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from backend.ops import mxfp4
from backend.models.config import ModelConfig
from backend.models.llama import CausalLM
from backend.ops import LayerOps
from backend.parallel.group import SINGLE, TensorParallel


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[.., 2I, ..] rows gate0, up0, gate1, up1, .. (dim 1) -> [gate rows | up rows]."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1).contiguous()


def _keep_packed(state: dict[str, torch.Tensor], experts: str) -> None:
    """MXFP4 tensors as the kernel reads them: bytes [E, rows, in / 2] and scales."""
    for proj in ("gate_up_proj", "down_proj"):
        blocks, scales = state.pop(f"{experts}.{proj}_blocks"), state.pop(f"{experts}.{proj}_scales")
        state[f"{experts}.{proj}"], state[f"{experts}.{proj}_scale"] = blocks.flatten(-2), scales


class GptOssCausalLM(CausalLM):
    # transformers' _keep_in_fp32_modules: the norms multiply in fp32, then round.
    fp32_params = ("layernorm.weight", "model.norm.weight")

    def __init__(self, cfg: ModelConfig, attn_factory: Callable[..., object], max_position: Optional[int] = None,
                 ops: Optional[LayerOps] = None, tp: TensorParallel = SINGLE) -> None:
        if cfg.mxfp4_experts and ops is not None and ops.backend == "triton":
            cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, packed_mxfp4=True))
        super().__init__(cfg, attn_factory, max_position, ops, tp)

    def adapt_checkpoint(self, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        keep_packed = self.config.moe.packed_mxfp4
        for i in range(cfg.num_layers):
            mlp = f"model.layers.{i}.mlp"
            experts = f"{mlp}.experts"
            packed = f"{experts}.gate_up_proj_blocks" in state
            if packed != cfg.mxfp4_experts and (packed or f"{experts}.gate_up_proj" in state):
                raise ValueError(f"{experts}: the checkpoint's tensors are {'MXFP4' if packed else 'not MXFP4'} "
                                 f"but quantization_config says {'mxfp4' if cfg.mxfp4_experts else 'none'}")
            if packed and keep_packed:
                _keep_packed(state, experts)
            elif packed:
                # Already [E, out, in]: the orientation the engine keeps.
                mxfp4.dequantize_experts(state, experts)
            elif f"{experts}.gate_up_proj" in state:
                for proj in ("gate_up_proj", "down_proj"):
                    state[f"{experts}.{proj}"] = state[f"{experts}.{proj}"].transpose(1, 2).contiguous()
            if f"{experts}.gate_up_proj_bias" in state:
                # A row is an output channel: bytes, scales, floats and biases reorder alike.
                for name in ("gate_up_proj", "gate_up_proj_scale", "gate_up_proj_bias"):
                    if f"{experts}.{name}" in state:
                        state[f"{experts}.{name}"] = _deinterleave(state[f"{experts}.{name}"])
            for suffix in ("weight", "bias"):
                if f"{mlp}.router.{suffix}" in state:
                    state[f"{mlp}.gate.{suffix}"] = state.pop(f"{mlp}.router.{suffix}")
        stray = [k for k in state if k.endswith(("_blocks", "_scales"))]
        if stray:
            raise ValueError(f"MXFP4 tensors outside the experts are not supported: {stray[:3]}")
        return state
