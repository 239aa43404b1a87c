"""Weight-only INT8/INT4 quantization of a Hugging Face checkpoint into the
compressed-tensors `pack-quantized` format (what llmcompressor writes and vLLM loads),
on CPU, round-to-nearest or GPTQ (builder/gptq.py) on calibration text.

compressed-tensors does the format: its quantization scheme (symmetric int, per group of
`group_size` input channels, or per channel), its qparams from each group's min/max, and
its ModelCompressor packs and writes config.json's quantization_config. The quality
report compares the source model with the same model on the dequantized weights (what
the engine computes) on held-out text.
"""

from __future__ import annotations

import os
import shutil
from typing import Callable, Optional

import torch

from backend.models.fp8 import QUANTIZED_LINEARS
from builder.gptq import gptq_model
from builder.entry_files import CHECKPOINT_FILES
from builder.quality import QualityReport, load_source, logit_quality

VISION_IGNORE = ("re:.*visual.*", "re:.*vision_tower.*", "re:.*multi_modal_projector.*")


def check_group_size(model, group_size: int) -> None:
    for name, mod in model.named_modules():
        if name.split(".")[-1] in QUANTIZED_LINEARS and mod.in_features % group_size:
            raise ValueError(f"group_size {group_size} does not divide {name}'s {mod.in_features} input channels")


@torch.no_grad()
def quantize_int_checkpoint(src: str, dst: str, bits: int, group_size: int, held_out_texts: list[str],
                            stage: Callable[[str, int], Callable[[], None]], algorithm: str = "rtn",
                            calibration_texts: Optional[list[str]] = None) -> QualityReport:
    """Writes dst (config, packed weights, tokenizer); returns the quality report.
    group_size -1: one scale per output channel. algorithm: "rtn" or "gptq" (which
    rounds on `calibration_texts`)."""
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    advance = stage("load", 1)
    model, encode = load_source(src, dtype=torch.float32)
    if group_size != -1:
        check_group_size(model, group_size)
    advance()
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True,
                            strategy="channel" if group_size == -1 else "group",
                            group_size=None if group_size == -1 else group_size)
    linears = {name: m for name, m in model.named_modules() if name.split(".")[-1] in QUANTIZED_LINEARS}
    advance = stage("quantize" if algorithm == "rtn" else "gptq", len(linears))
    qparams, dequantized = {}, {}

    def group_qparams(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero point of each group (the last dimension) from its min and max."""
        return calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    if algorithm == "gptq":
        column_args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="channel")

        def fake_quantize_column(col: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
            return fake_quantize(col[:, None], scale[:, None], zero[:, None], column_args)[:, 0]
        if not calibration_texts:
            raise RuntimeError("GPTQ needs calibration text")
        results = gptq_model(model, linears, encode(calibration_texts), group_qparams, fake_quantize_column,
                             group_size, advance)
        for name, (deq, scale, zero) in results.items():
            qparams[name], dequantized[name] = (scale, zero), deq
    else:
        for name, m in linears.items():
            w = m.weight.data
            g = w.shape[1] if group_size == -1 else group_size
            groups = w.reshape(w.shape[0], -1, g)
            scale, zero = group_qparams(groups)
            scale, zero = scale.reshape(w.shape[0], -1), zero.reshape(w.shape[0], -1)
            qparams[name] = (scale, zero)
            dequantized[name] = fake_quantize(w, scale, zero, args)
            advance()
    # Before the scheme is attached: the reference is the source model as it is.
    advance = stage("evaluate", 1)
    report = logit_quality(model, encode(held_out_texts), dequantized)
    advance()
    advance = stage("write", 1)
    # A vision-language model (quality.LanguageModelView): the whole model is written, its
    # vision tower and projector left as they are.
    full = getattr(model, "full", model)
    apply_quantization_config(full, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        ignore=["lm_head"] + (list(VISION_IGNORE) if full is not model else [])))
    for name, m in full.named_modules():
        if hasattr(m, "weight_scale"):
            # compressed-tensors' compressor rounds the weight on the grid given here; GPTQ's
            # dequantized weights sit on that grid, so they round back to GPTQ's integers.
            m.weight.data = dequantized[name].to(m.weight.dtype)
            scale, zero = qparams[name]
            m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
            m.weight_zero_point.data.copy_(zero.reshape(m.weight_zero_point.shape).to(m.weight_zero_point.dtype))
    save_compressed(full, src, dst, "pack-quantized")
    advance()
    return report


def save_compressed(model, src: str, dst: str, quantization_format: str) -> None:
    """compressed-tensors compresses the model (its quantization config applied, its
    qparams set) in `quantization_format` and writes dst with config.json's
    quantization_config; the source's tokenizer and generation files go next to it."""
    from compressed_tensors.compressors import ModelCompressor
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=quantization_format)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    for f in sorted(os.listdir(src)):       # the source's side files, as an FP8 build copies them
        full = os.path.join(src, f)
        if (os.path.isfile(full) and f.endswith(CHECKPOINT_FILES) and f != "config.json"
                and not f.endswith(".safetensors") and f != "model.safetensors.index.json"
                and not os.path.exists(os.path.join(dst, f))):
            shutil.copy2(full, os.path.join(dst, f))
