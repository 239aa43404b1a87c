"""FP8 (E4M3) quantization of a Hugging Face checkpoint, on CPU.

- Weights: per-output-channel scales from the weights themselves.
- Activations: one static scale per linear input, from the max |x| seen on calibration
  prompts.
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
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from backend.models.fp8 import FP8_MAX, QUANT_METHOD, QUANTIZED_LINEARS, fake_quantize, quantize_per_channel

CORPUS = os.path.join(os.path.dirname(__file__), "data", "corpus.txt")


def default_texts() -> tuple[list[str], list[str]]:
    """Calibration and held-out paragraphs from the embedded corpus (disjoint)."""
    with open(CORPUS, encoding="utf-8") as f:
        paras = [p.strip() for p in f.read().split("\n\n") if len(p.strip()) > 200]
    return paras[:32], paras[-16:]


@dataclass
class QualityReport:
    held_out_tokens: int
    relative_logit_error: float
    top1_agreement: float


def _linears(model) -> dict[str, torch.nn.Linear]:
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.split(".")[-1] in QUANTIZED_LINEARS:
            out[name] = mod
    return out


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
    try:
        for ids in batches:
            model(ids[None])
    finally:
        for h in hooks:
            h.remove()
    kv_scales = [(max(k * math.sqrt(2), 1e-6) / FP8_MAX, max(v, 1e-6) / FP8_MAX) for k, v in kv]
    return {n: max(a, 1e-6) / FP8_MAX for n, a in act.items()}, kv_scales


@torch.no_grad()
def quality(model, fp8_state: dict[str, torch.Tensor], input_scales: dict[str, float],
            texts: list[torch.Tensor]) -> QualityReport:
    """Source logits vs the same model with FP8 numerics swapped in."""
    ref = [model(ids[None]).logits[0].float() for ids in texts]
    saved = {}
    hooks = []
    for name, lin in _linears(model).items():
        saved[name] = lin.weight.data.clone()
        w = fp8_state[f"{name}.weight"].float() * fp8_state[f"{name}.weight_scale"][:, None]
        lin.weight.data = w.to(lin.weight.dtype)
        scale = torch.tensor(input_scales[name])
        hooks.append(lin.register_forward_pre_hook(lambda mod, args, s=scale: (fake_quantize(args[0], s),)))
    try:
        got = [model(ids[None]).logits[0].float() for ids in texts]
    finally:
        for h in hooks:
            h.remove()
        for name, lin in _linears(model).items():
            lin.weight.data = saved[name]
    num = sum((g - r).norm() ** 2 for g, r in zip(got, ref)) ** 0.5
    den = sum(r.norm() ** 2 for r in ref) ** 0.5
    agree = sum((g.argmax(-1) == r.argmax(-1)).sum().item() for g, r in zip(got, ref))
    n = sum(r.shape[0] for r in ref)
    return QualityReport(held_out_tokens=n, relative_logit_error=float(num / den), top1_agreement=agree / n)


def quantize_checkpoint(src: str, calibration_texts: list[str], held_out_texts: list[str],
                        stage: Callable[[str, int], Callable[[], None]]) -> tuple[dict, dict, QualityReport]:
    """Returns (state dict to save, quantization_config, quality report).

    `stage(name, steps)` opens a progress stage and returns its `advance` callable."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    advance = stage("load", 1)
    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto").eval()
    tok = AutoTokenizer.from_pretrained(src) if any(
        os.path.isfile(os.path.join(src, f)) for f in ("tokenizer.json", "tokenizer.model")) else None
    advance()

    def encode(texts: list[str]) -> list[torch.Tensor]:
        if tok is None:  # token-id-only checkpoints: bytes of the text as ids, in range
            vocab = model.config.vocab_size
            return [torch.tensor([b % vocab for b in t.encode()][:256]) for t in texts]
        return [torch.tensor(tok.encode(t)[:256]) for t in texts]

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
        state[f"{name}.input_scale"] = torch.tensor(input_scales[name], dtype=torch.float32)
        advance()
    advance = stage("evaluate", 1)
    report = quality(model, state, input_scales, held)
    advance()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    qcfg = {"quant_method": QUANT_METHOD, "weights": "fp8_e4m3_per_channel",
            "activations": "fp8_e4m3_static_per_tensor", "kv_cache_scales": [list(s) for s in kv_scales],
            "quality": asdict(report)}
    return state, qcfg, report
