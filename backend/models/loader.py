"""Load a local Hugging Face checkpoint folder: weights and tokenizer."""

from __future__ import annotations

import glob
import os
from typing import Callable, Optional

import torch
from safetensors.torch import load_file

from backend.models.config import ModelConfig
from backend.models.llama import CausalLM
from backend.models.moe import stack_experts
from backend.models.moe_fp8 import fp8_experts_state_dict, is_fp8_moe, swap_in_fp8_experts
from backend.models.projections import FUSED_PROJECTIONS
from backend.models.quant_linears import (QUANTIZED_LINEARS, quantized_state_dict, single_rank_only,
                                          swap_in_quantized_linears)
from backend.models.registry import model_class
from backend.ops import LayerOps
from backend.parallel.group import SINGLE, TensorParallel
from backend.parallel.pipeline import PipelineStage, PipelineStageModel, keep_stage, stage_weights
from backend.parallel.sharding import load_shard, local_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_weights(path: str) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in checkpoint folder '{path}'")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state




def fuse_projections(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Concatenate q/k/v and gate/up in a Hugging Face state dict (in place). FP8
    checkpoints: weights and per-channel scales concatenate; the static input scales,
    calibrated on the one input the parts share, merge as their max."""
    for i in range(num_layers):
        for fused, parts in FUSED_PROJECTIONS.items():
            names = [f"model.layers.{i}.{p}" for p in parts]
            if f"{names[0]}.weight" not in state:
                continue
            for suffix in ("weight", "bias", "weight_scale"):
                tensors = [state.pop(f"{n}.{suffix}", None) for n in names]
                if tensors[0] is not None:
                    state[f"model.layers.{i}.{fused}.{suffix}"] = _cat_rows(tensors)
            scales = [state.pop(f"{n}.input_scale", None) for n in names]
            if scales[0] is not None:
                state[f"model.layers.{i}.{fused}.input_scale"] = torch.stack(scales).amax()
    return state


def _cat_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    if tensors[0].dtype == torch.float8_e4m3fn:   # cat has no FP8 kernel everywhere; bytes are bytes
        return torch.cat([t.view(torch.uint8) for t in tensors]).view(torch.float8_e4m3fn)
    return torch.cat(tensors)


def load_model(path: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               attn_factory: Callable[..., object], max_position: int, ops: Optional[LayerOps] = None,
               tp: TensorParallel = SINGLE, int_kernel: bool = False, pooling: bool = False,
               stage: Optional[PipelineStage] = None) -> CausalLM:
    """The model, or with tp.size > 1 this rank's shard of it (reading only its slices);
    with a pipeline stage, the stage's part of it (backend/parallel/pipeline.py).
    pooling (runner="pooling"): an embedding checkpoint may be the bare decoder saved
    without the `model.` prefix and without an LM head (Qwen3-Embedding is), as vLLM
    loads both; the head is then tied to the embedding (never used, and no memory)."""
    one_rank = single_rank_only(cfg.quantization)
    if one_rank is not None and tp.size > 1:
        raise ValueError(f"{one_rank} checkpoints run on one rank: use tensor_parallel_size=1")
    if is_fp8_moe(cfg.quantization, cfg.moe) and tp.size > 1:
        raise ValueError("FP8 mixture-of-experts builds run on one rank: use tensor_parallel_size=1")
    local = local_config(cfg, tp.size)
    with torch.device("meta"):
        model = model_class(cfg)(local, attn_factory, max_position, ops, tp)
        swap_in_quantized_linears(model, cfg.quantization, int_kernel)
        fp8_moe = is_fp8_moe(cfg.quantization, cfg.moe)
        if fp8_moe:
            swap_in_fp8_experts(model)
        if stage is not None:
            keep_stage(model, stage)
    if stage is not None:
        weights = load_shard(path, cfg, tp.rank, tp.size, keep=lambda n: stage.owns(n, cfg.tie_word_embeddings))
    else:
        weights = load_weights(path) if tp.size == 1 else load_shard(path, cfg, tp.rank, tp.size)
    remap = getattr(model, "remap_names", None)
    if remap is not None:       # vision-language checkpoints' layouts (vision_lm.py)
        weights = remap(weights)
    if pooling and not any(k.startswith("model.") for k in weights):
        weights = {k if k.startswith("lm_head.") else f"model.{k}": v for k, v in weights.items()}
    tied = cfg.tie_word_embeddings or (pooling and "lm_head.weight" not in weights)
    if stage is not None:
        tied = stage_weights(weights, stage, tied)
    weights = quantized_state_dict(weights, cfg.num_layers, cfg.quantization)
    if fp8_moe:
        weights = fp8_experts_state_dict(weights)
    state = model.adapt_checkpoint(cfg, fuse_projections(stack_experts(weights, local, tp.rank), cfg.num_layers))
    if tied:
        state.pop("lm_head.weight", None)
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        # assign=True replaced the embedding's tensor; point the head at the new one.
        model.lm_head.weight = model.model.embed_tokens.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"checkpoint '{path}' lacks weights: {missing[:5]}")
    # Buffers (rotary tables) were built on meta: rebuild them for real.
    model.build_buffers(max_position)
    model = model.to(device=device)
    # Cast to the compute dtype everything except the quantized layers (their weights stay
    # FP8 / INT8 / packed, their scales as the checkpoint has them).
    for module_name, module in model.named_modules():
        if isinstance(module, QUANTIZED_LINEARS) or getattr(module, "quantized", False):
            continue
        for name, p in list(module.named_parameters(recurse=False)):
            if f"{module_name}.{name}".endswith(model.fp32_params):
                continue                            # kept in fp32, as transformers keeps them
            if p.is_floating_point() and p.dtype != dtype:
                setattr(module, name, torch.nn.Parameter(p.data.to(dtype), requires_grad=False))
        for name, b in list(module.named_buffers(recurse=False)):
            if b.is_floating_point():
                setattr(module, name, b.to(dtype))
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.eval().requires_grad_(False)
    return model if stage is None else PipelineStageModel(model, stage, dtype)


def load_tokenizer(path: str):
    """The checkpoint's tokenizer, or None when the folder has none (token-id prompts only)."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)
