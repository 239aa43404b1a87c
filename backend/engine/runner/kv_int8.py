"""INT8 KV cache scales: symmetric, one per layer and KV head for K and for V
(scale = max |x| / 127 over calibration prompts, K after RoPE), calibrated by the builder
(builder/kv_int8.py) and stored in the model-repository entry as a safetensors file with
vLLM's per-head scale names, `model.layers.N.self_attn.k_scale` / `v_scale`, each
[num_kv_heads] fp32 (what vLLM loads for per-attention-head KV scales). The engine
arguments are vLLM's `kv_cache_dtype="int8"` plus the file (`kv_cache_scales`).

The cache stores round(x / scale) clamped to [-127, 127]; attention reads stored * scale
(backend/attention/torch_attention.py and the Triton kernels)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from backend.config import ConfigError
from backend.models.config import ModelConfig

KV_SCALE_NAME = "model.layers.{layer}.self_attn.{which}_scale"

Scales = list[tuple[list[float], list[float]]]      # per layer: (K scales, V scales), one per KV head


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return {"fp8": torch.float8_e4m3fn, "int8": torch.int8}.get(kv_cache_dtype, model_dtype)


def save_kv_cache_scales(path: str, k_scales: torch.Tensor, v_scales: torch.Tensor) -> None:
    """k_scales, v_scales: [num_layers, num_kv_heads]."""
    from safetensors.torch import save_file
    tensors = {}
    for i in range(k_scales.shape[0]):
        tensors[KV_SCALE_NAME.format(layer=i, which="k")] = k_scales[i].float().contiguous()
        tensors[KV_SCALE_NAME.format(layer=i, which="v")] = v_scales[i].float().contiguous()
    save_file(tensors, path, metadata={"kv_cache_dtype": "int8"})


def load_kv_cache_scales(path: str, cfg: ModelConfig, heads: Optional[tuple[int, int]] = None) -> Scales:
    """The file's scales for every layer, checked against the model; `heads`: this
    tensor-parallel rank's KV heads [start, stop) (backend/parallel/sharding.kv_head_range)."""
    from safetensors.torch import load_file
    try:
        tensors = load_file(path)
    except (OSError, RuntimeError) as e:     # missing file, not safetensors
        raise ConfigError(f"invalid engine argument 'kv_cache_scales': '{path}' cannot be read: {e}") from None
    lo, hi = heads or (0, cfg.num_kv_heads)
    out: Scales = []
    for i in range(cfg.num_layers):
        pair = []
        for which in ("k", "v"):
            name = KV_SCALE_NAME.format(layer=i, which=which)
            t = tensors.get(name)
            if t is None or t.shape != (cfg.num_kv_heads,):
                got = "missing" if t is None else f"shape {tuple(t.shape)}"
                raise ConfigError(f"invalid engine argument 'kv_cache_scales': in '{path}', {name} is {got}; "
                                  f"expected [{cfg.num_kv_heads}] (one scale per KV head)")
            vals = [float(x) for x in t.float()[lo:hi]]
            if not all(math.isfinite(x) and x > 0 for x in vals):
                raise ConfigError(f"invalid engine argument 'kv_cache_scales': in '{path}', {name} has a scale that "
                                  "is not a positive number")
            pair.append(vals)
        out.append((pair[0], pair[1]))
    return out


def set_kv_cache_scales(layers: list, scales: Scales) -> None:
    """Give each layer of an INT8 cache (KVCacheLayer) its per-head scales."""
    for layer, (k, v) in zip(layers, scales):
        layer.k_scale, layer.v_scale = k, v
