"""Load a local Hugging Face checkpoint folder: weights and tokenizer."""

from __future__ import annotations

import glob
import os
from typing import Callable, Optional

import torch
from safetensors.torch import load_file

from backend.models.config import ModelConfig
from backend.models.fp8 import FP8Linear, swap_in_fp8_linears
from backend.models.llama import CausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_weights(path: str) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in checkpoint folder '{path}'")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def load_model(path: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               attn_factory: Callable[..., object], max_position: int) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(cfg, attn_factory, max_position)
        if cfg.quantization is not None:
            swap_in_fp8_linears(model)
    state = load_weights(path)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        # assign=True replaced the embedding's tensor; point the head at the new one.
        model.lm_head.weight = model.model.embed_tokens.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"checkpoint '{path}' lacks weights: {missing[:5]}")
    # Buffers (rotary tables) were built on meta: rebuild them for real.
    model.rotary = type(model.rotary)(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
    model = model.to(device=device)
    # Cast to the compute dtype everything except FP8 layers (their weights stay FP8,
    # their scales fp32).
    for module in model.modules():
        if isinstance(module, FP8Linear):
            continue
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_floating_point() and p.dtype != dtype:
                setattr(module, name, torch.nn.Parameter(p.data.to(dtype), requires_grad=False))
        for name, b in list(module.named_buffers(recurse=False)):
            if b.is_floating_point():
                setattr(module, name, b.to(dtype))
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def load_tokenizer(path: str):
    """The checkpoint's tokenizer, or None when the folder has none (token-id prompts only)."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)
