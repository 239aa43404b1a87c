"""FP8 (E4M3) quantization of a Hugging Face checkpoint, on CPU.

- Weights: per-output-channel scales from the weights themselves.
- Activations: one static scale per linear input, from the max |x| seen on calibration
  prompts; or (activation_scheme "dynamic") none stored: each token's scale is computed
  at run time.
- Mixture-of-experts (Mixtral, Qwen2-MoE, Qwen3-MoE): the stacked experts get per-expert,
  per-output-channel scales and run weight-only (backend/models/moe_fp8.py); the router
  and the shared expert stay in the source dtype.
- KV cache: one K and one V scale per layer from the same pass. K is observed before
  RoPE (after q/k norm where the model has one); a 2-D rotation can raise one element's
  magnitude by at most sqrt(2), so that bound is applied.
- Quality report: on held-out text, the FP8 numerics (rounded activations x dequantized
  weights, what the engine computes) against the source model in its own precision:
  relative logit error and top-1 agreement.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict
from typing import Callable, Optional

import torch

from backend.models.fp8 import (FP8_MAX, QUANT_METHOD, QUANTIZED_LINEARS, fake_quantize, per_token_scale,
                                quantize_per_channel)
from backend.models.moe_fp8 import EXPERT_WEIGHTS, SCALE_SUFFIX, quantize_experts
from backend.ops.fp8_quant import dequantize_experts
from builder.quality import QualityReport, load_source, logit_quality, run_with_hooks

CORPUS = os.path.join(os.path.dirname(__file__), "data", "corpus.txt")


def default_texts() -> tuple[list[str], list[str]]:
    """Calibration and held-out paragraphs from the embedded corpus (disjoint)."""
    with open(CORPUS, encoding="utf-8") as f:
        paras = [p.strip() for p in f.read().split("\n\n") if len(p.strip()) > 200]
    return paras[:32], paras[-16:]


def _linears(model) -> dict[str, torch.nn.Linear]:
    # Qwen2-MoE's shared expert stays in the source dtype (backend/models/moe_fp8.py).
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.split(".")[-1] in QUANTIZED_LINEARS \
                and ".shared_expert." not in name:
            out[name] = mod
    return out


def _expert_stacks(model) -> dict[str, torch.Tensor]:
    """transformers' stacked expert parameters ([E, 2I, H] gate_up, [E, H, I] down) by
    state-dict name; empty for dense models."""
    return {n: p for n, p in model.named_parameters() if n.endswith(EXPERT_WEIGHTS) and p.dim() == 3}


@torch.no_grad()
def calibrate(model, batches: list[torch.Tensor]) -> tuple[dict[str, float], list[tuple[float, float]]]:
    """max |input| per quantized linear, and (k_amax, v_amax) per layer."""
    act: dict[str, float] = {}
    kv = [[0.0, 0.0] for _ in model.model.layers]
    hooks = []
    for name, lin in _linears(model).items():
        def pre(mod, args, name=name):
            act[name] = max(act.get(name, 0.0), args[0].abs().max().item())
        hooks.append(lin.register_forward_pre_hook(pre))
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        k_src = getattr(attn, "k_norm", None) or attn.k_proj

        def k_hook(mod, args, out, i=i):
            kv[i][0] = max(kv[i][0], out.abs().max().item())

        def v_hook(mod, args, out, i=i):
            kv[i][1] = max(kv[i][1], out.abs().max().item())
        hooks += [k_src.register_forward_hook(k_hook), attn.v_proj.register_forward_hook(v_hook)]
    run_with_hooks(model, batches, hooks)
    kv_scales = [(max(k * math.sqrt(2), 1e-6) / FP8_MAX, max(v, 1e-6) / FP8_MAX) for k, v in kv]
    return {n: max(a, 1e-6) / FP8_MAX for n, a in act.items()}, kv_scales


def quality(model, fp8_state: dict[str, torch.Tensor], input_scales: Optional[dict[str, float]],
            texts: list[torch.Tensor]) -> QualityReport:
    """Source logits vs the same model with FP8 numerics swapped in: dequantized weights,
    activations rounded through FP8 with their static scales (None: per-token scales)."""
    weights = {name: fp8_state[f"{name}.weight"].float() * fp8_state[f"{name}.weight_scale"][:, None]
               for name in _linears(model)}
    experts = _expert_stacks(model)

    def round_input(name: str):
        if input_scales is None:
            return lambda mod, args: (fake_quantize(args[0], per_token_scale(args[0])),)
        scale = torch.tensor(input_scales[name])
        return lambda mod, args: (fake_quantize(args[0], scale),)
    # The experts run weight-only FP8: their dequantized stacks swapped in, inputs unrounded.
    saved = {n: p.data for n, p in experts.items()}
    try:
        for n, p in experts.items():
            p.data = dequantize_experts(fp8_state[n], fp8_state[n + SCALE_SUFFIX]).to(p.dtype)
        return logit_quality(model, texts, weights, round_input)
    finally:
        for n, p in experts.items():
            p.data = saved[n]


def quantize_checkpoint(src: str, calibration_texts: list[str], held_out_texts: list[str],
                        stage: Callable[[str, int], Callable[[], None]],
                        activation_scheme: str = "static") -> tuple[dict, dict, QualityReport]:
    """Returns (state dict to save, quantization_config, quality report).
    activation_scheme "static" or "dynamic" (no input scales stored).

    `stage(name, steps)` opens a progress stage and returns its `advance` callable."""
    advance = stage("load", 1)
    model, encode = load_source(src)
    advance()
    calib, held = encode(calibration_texts), encode(held_out_texts)
    advance = stage("calibrate", 1)
    input_scales, kv_scales = calibrate(model, calib)
    advance()

    linears = _linears(model)
    advance = stage("quantize", len(linears))
    state = {k: v for k, v in model.state_dict().items()}
    for name, lin in linears.items():
        q, s = quantize_per_channel(lin.weight.data)
        state[f"{name}.weight"] = q
        state[f"{name}.weight_scale"] = s
        if activation_scheme == "static":
            state[f"{name}.input_scale"] = torch.tensor(input_scales[name], dtype=torch.float32)
        advance()
    for name, w in _expert_stacks(model).items():
        state[name], state[name + SCALE_SUFFIX] = quantize_experts(w.data)
    advance = stage("evaluate", 1)
    report = quality(model, state, input_scales if activation_scheme == "static" else None, held)
    advance()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    activations = "static_per_tensor" if activation_scheme == "static" else "dynamic_per_token"
    qcfg = {"quant_method": QUANT_METHOD, "weights": "fp8_e4m3_per_channel", "activation_scheme": activation_scheme,
            **({"experts": "fp8_e4m3_per_expert_per_channel_weight_only"} if _expert_stacks(model) else {}),
            "activations": f"fp8_e4m3_{activations}", "kv_cache_scales": [list(s) for s in kv_scales],
            "quality": asdict(report)}
    return state, qcfg, report
