"""INT8 KV cache calibration (`python -m builder build --kv-cache int8`): run the source
model on the calibration prompts, take max |K| and max |V| per layer and KV head as
attention sees them (K after RoPE and any q/k norm), and store scale = amax / 127 in the
entry (backend/engine/runner/kv_int8.py names the file's tensors).

K/V are observed through a transformers attention function that wraps SDPA (`kv_hook`),
so what is measured is exactly the tensor the cache will hold; the tests use the same
hook to run transformers on fake-quantized K/V.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable

import torch

from backend.engine.runner.kv_int8 import save_kv_cache_scales

KV_SCALES_FILE = "kv_cache_scales.safetensors"
INT8_MAX = 127.0
_HOOK_NAME = "paged_llm_kv_hook"


@contextmanager
def kv_hook(model, fn: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]):
    """Within the block, every attention call of `model` (a transformers decoder) passes
    its layer index and K, V ([B, KVH, L, D], the whole cache as attention reads it) to
    fn, and attends over the K, V fn returns (SDPA otherwise as usual)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def attention(module, query, key, value, *args, **kwargs):
        key, value = fn(module.layer_idx, key, value)
        return sdpa(module, query, key, value, *args, **kwargs)
    AttentionInterface.register(_HOOK_NAME, attention)
    before = model.config._attn_implementation
    model.set_attn_implementation(_HOOK_NAME)
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


@torch.no_grad()
def calibrate_kv_int8(model, batches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(K scales, V scales), each [num_layers, num_kv_heads] fp32: max |x| / 127 over the
    prompts (a floor keeps a head that saw only zeros valid)."""
    cfg = model.config
    kvh = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    amax = torch.zeros(2, cfg.num_hidden_layers, kvh)

    def observe(layer, key, value):
        for i, x in enumerate((key, value)):
            amax[i, layer] = torch.maximum(amax[i, layer], x.detach().float().abs().amax(dim=(0, 2, 3)).cpu())
        return key, value
    with kv_hook(model, observe):
        for ids in batches:
            model(ids[None], use_cache=False)
    scales = amax.clamp(min=1e-6) / INT8_MAX
    return scales[0], scales[1]


def write_kv_int8_scales(src: str, out_dir: str, texts: list[str], stage) -> str:
    """Calibrate on `texts` and write the scales file into the entry; returns its name."""
    from builder.quality import load_source
    advance = stage("calibrate", 1)
    model, encode = load_source(src)
    k, v = calibrate_kv_int8(model, encode(texts))
    save_kv_cache_scales(os.path.join(out_dir, KV_SCALES_FILE), k, v)
    advance()
    return KV_SCALES_FILE
