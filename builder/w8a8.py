"""W8A8 INT8 quantization of a Hugging Face checkpoint (SmoothQuant, then per-channel
INT8 weights; activations are quantized per token at run time), written as
compressed-tensors `int-quantized`, the format llmcompressor writes and vLLM and our
engine (backend/models/w8a8.py) load.

SmoothQuant (Xiao et al., 2023): activations have a few channels of large magnitude that
per-token INT8 rounds badly, weights do not. Each input channel j of the projections that
follow a norm is scaled: x_j / s_j into the GEMM, W[:, j] * s_j in the weight, with
s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) (max|X_j| over calibration prompts, max|W_j|
over the projections sharing the input), which moves part of the activation range into
the weights. The division is folded into the preceding norm's weight, so the smoothed
model computes the same function and the engine needs nothing at run time. The pairs are
llmcompressor's default mappings: q/k/v after the input norm, gate/up after the MLP's
input norm (o_proj and down_proj are quantized unsmoothed). Gemma's norms multiply by
(1 + w): the fold keeps that form.

The quality report compares the source model with the smoothed model on the dequantized
weights and per-token fake-quantized activations (what the engine computes) on held-out text.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from backend.models.fp8 import PROJECTIONS
from backend.models.w8a8 import quantize_per_token
from builder.int_quant import save_compressed
from builder.quality import QualityReport, load_source, logit_quality, run_with_hooks

DEFAULT_ALPHA = 0.5


def _smooth_pairs(model) -> list[tuple[torch.nn.Module, list[torch.nn.Linear]]]:
    """(norm, the projections it feeds) per layer: llmcompressor's default mappings."""
    pairs = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        mlp_norm = getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm
        pairs.append((layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj]))
        pairs.append((mlp_norm, [mlp.gate_proj, mlp.up_proj]))
    return pairs


@torch.no_grad()
def activation_max(model, pairs, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """max |x| per input channel of each pair's shared input, over the calibration prompts."""
    out: list[Optional[torch.Tensor]] = [None] * len(pairs)
    hooks = []
    for i, (_, linears) in enumerate(pairs):
        def pre(mod, args, i=i):
            m = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).float()
            out[i] = m if out[i] is None else torch.maximum(out[i], m)
        hooks.append(linears[0].register_forward_pre_hook(pre))
    run_with_hooks(model, batches, hooks)
    return out


@torch.no_grad()
def smooth(model, batches: list[torch.Tensor], alpha: float) -> None:
    """Fold SmoothQuant's per-channel scales into the norms and projections (in place)."""
    norm_offset = 1.0 if model.config.model_type.startswith("gemma") else 0.0
    pairs = _smooth_pairs(model)
    for (norm, linears), act in zip(pairs, activation_max(model, pairs, batches)):
        w_max = torch.cat([lin.weight.float() for lin in linears]).abs().amax(0)
        s = act.clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)
        s = torch.where(w_max > 0, s, torch.ones_like(s)).clamp(min=1e-5)
        norm.weight.data = ((norm.weight.float() + norm_offset) / s - norm_offset).to(norm.weight.dtype)
        for lin in linears:
            lin.weight.data = (lin.weight.float() * s[None, :]).to(lin.weight.dtype)


def fake_quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    """What the W8A8 GEMM's input is: each token rounded to INT8 with its own scale."""
    q, scale = quantize_per_token(x.reshape(-1, x.shape[-1]))
    return (q.float() * scale[:, None]).to(x.dtype).reshape(x.shape)


@torch.no_grad()
def quantize_w8a8_checkpoint(src: str, dst: str, calibration_texts: list[str], held_out_texts: list[str],
                             stage: Callable[[str, int], Callable[[], None]],
                             alpha: float = DEFAULT_ALPHA) -> QualityReport:
    """Writes dst (config, int8 weights, tokenizer); returns the quality report. This is
    what `builder build --weights w8a8` runs; a report can call it directly."""
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    advance = stage("load", 1)
    model, encode = load_source(src, dtype=torch.float32)
    advance()
    if model.config.model_type not in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"):
        raise ValueError(f"W8A8 smoothing maps norms to projections for dense Llama/Mistral/Qwen/Gemma decoders, "
                         f"not model_type {model.config.model_type!r}")
    advance = stage("smooth", 1)
    source = [model(ids[None]).logits[0].float() for ids in encode(held_out_texts)]
    smooth(model, encode(calibration_texts), alpha)
    advance()
    weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    linears = {n: m for n, m in model.named_modules() if any(n.endswith(p) for p in PROJECTIONS)}
    advance = stage("quantize", len(linears))
    qparams, dequantized = {}, {}
    for name, m in linears.items():
        w = m.weight.data
        scale, zero = calculate_qparams(w.amin(-1, keepdim=True), w.amax(-1, keepdim=True), weights)
        qparams[name] = scale
        dequantized[name] = fake_quantize(w, scale, zero, weights)
        advance()
    advance = stage("evaluate", 1)
    report = logit_quality(model, encode(held_out_texts), dequantized,
                           lambda name: lambda mod, args: (fake_quantize_per_token(args[0]),), reference=source)
    advance()
    advance = stage("write", 1)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": QuantizationScheme(
        targets=["Linear"], weights=weights, input_activations=acts)}, ignore=["lm_head"]))
    for name, m in model.named_modules():
        if hasattr(m, "weight_scale"):
            # The compressor rounds the weight on the grid given here: the dequantized
            # weights round back to the same integers the report measured.
            m.weight.data = dequantized[name].to(m.weight.dtype)
            m.weight_scale.data.copy_(qparams[name].reshape(m.weight_scale.shape))
    save_compressed(model, src, dst, "int-quantized")
    advance()
    return report
