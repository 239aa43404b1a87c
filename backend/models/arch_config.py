"""Parts of config.json that differ from Llama's: RoPE (Llama 3, linear, LongRoPE,
YaRN, Gemma 3's two bases), which layers slide, and Gemma's attention extras.

Each rule follows the transformers config class of the family (its defaults included,
since configs saved by older versions omit values equal to them). What differs by
family is a field of its row in the architecture table (architectures.py), which
these functions read: no rule here names a family."""

from __future__ import annotations

import math
from typing import Any, Optional

from backend.models.architectures import Architecture


class ArchConfigError(ValueError):
    pass


def _split_rope(cfg: dict[str, Any], arch: Architecture) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """(global RoPE parameters, Gemma 3's sliding-layer parameters or None). transformers
    >= 5 writes rope_parameters (nested by layer type for Gemma 3); older checkpoints
    rope_theta + rope_scaling (+ rope_local_base_freq)."""
    params = dict(cfg.get("rope_parameters") or {})
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full = params
        local = None
    full.setdefault("rope_theta", cfg.get("rope_theta", arch.rope_theta))
    if len(full) == 1:      # only the theta: the older fields hold the scaling
        full.update(cfg.get("rope_scaling") or arch.default_rope_scaling or {})
    if arch.local_rope and local is None:
        local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    return full, local


def rope_fields(cfg: dict[str, Any], arch: Architecture) -> dict[str, Any]:
    """rope_theta, rope_scaling (None or a dict with its rope_type), local_rope_theta and
    partial_rotary_factor (RoPE over the first int(head_dim * factor) channels: Phi-4-mini)."""
    full, local = _split_rope(cfg, arch)
    theta = float(full.pop("rope_theta"))
    # M-RoPE (Qwen2-VL): ordinary frequencies, split in sections by the model (qwen2_vl.py).
    if full.pop("mrope_section", None) is not None and full.get("rope_type", full.get("type")) in (None, "mrope"):
        full["rope_type"] = "default"
    partial = float(full.pop("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0)
    rope_type = full.get("rope_type", full.get("type", "default"))
    if rope_type in ("su",) or (arch.yarn_means_longrope and rope_type == "yarn"):
        rope_type = "longrope"   # Phi-3's older names, as transformers' Phi3Config maps them
    scaling: Optional[dict[str, Any]]
    if rope_type == "default":
        scaling = None
    elif rope_type == "llama3":
        scaling = {**full, "rope_type": "llama3"}
    elif rope_type == "linear":
        scaling = {"rope_type": "linear", "factor": float(full["factor"])}
    elif rope_type == "longrope":
        scaling = _longrope(full, cfg)
    elif rope_type == "yarn":
        scaling = _yarn(full, cfg)
    else:
        raise ArchConfigError(f"unsupported rope_type '{rope_type}' (supported: default, llama3, linear, "
                              "longrope, yarn)")
    local_theta = None
    if local is not None:
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise ArchConfigError("unsupported RoPE scaling on Gemma 3's sliding layers")
        local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
    return {"rope_theta": theta, "rope_scaling": scaling, "local_rope_theta": local_theta,
            "partial_rotary_factor": partial}


def _context_extension(params: dict[str, Any], cfg: dict[str, Any], rope_type: str) -> tuple[int, float]:
    """(original_max_position_embeddings, factor) of LongRoPE / YaRN: Phi-3's top-level
    original wins for LongRoPE, the RoPE parameters' own for YaRN (as transformers reads
    each); factor defaults to max_position_embeddings / original."""
    key = "original_max_position_embeddings"
    first, second = (cfg, params) if rope_type == "longrope" else (params, cfg)
    original = first.get(key) or second.get(key)
    if not original:
        raise ArchConfigError(f"rope_type '{rope_type}' needs original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        factor = cfg.get("max_position_embeddings", 2048) / original
    return int(original), float(factor)


def _longrope(params: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE as transformers computes it: attention_factor defaults to
    sqrt(1 + ln f / ln orig)."""
    original, factor = _context_extension(params, cfg, "longrope")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_type": "longrope", "short_factor": [float(x) for x in params["short_factor"]],
            "long_factor": [float(x) for x in params["long_factor"]],
            "original_max_position_embeddings": int(original), "attention_factor": float(attention_factor)}


def _yarn(params: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """YaRN as transformers' _compute_yarn_parameters reads it: factor defaults to
    max / original; attention_factor (cos and sin are scaled by it) to
    0.1 ln(factor) + 1, or the mscale / mscale_all_dim ratio when both are given;
    beta_fast 32, beta_slow 1; the correction range is truncated unless truncate is false."""
    original, factor = _context_extension(params, cfg, "yarn")

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            attention_factor = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            "beta_fast": float(params.get("beta_fast") or 32), "beta_slow": float(params.get("beta_slow") or 1),
            "truncate": bool(params.get("truncate", True)), "attention_factor": float(attention_factor)}


def sliding_windows(cfg: dict[str, Any], arch: Architecture, num_layers: int) -> tuple[Optional[int], ...]:
    """Per layer: None for full attention, else the window (keys within the last
    `window` positions, the query's own included)."""
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if arch.windows == "qwen":
        # transformers: no window unless use_sliding_window, and then only from layer
        # max_window_layers on (unless layer_types says otherwise).
        if not cfg.get("use_sliding_window"):
            window = None
        if layer_types:
            return tuple(window if t == "sliding_attention" else None for t in layer_types)
        first = int(cfg.get("max_window_layers", 28))
        return tuple(window if i >= first else None for i in range(num_layers))
    if arch.windows == "all":
        return tuple(window for _ in range(num_layers))
    if arch.windows in ("alternating", "pattern"):
        if not layer_types:
            # Gemma 2 and gpt-oss alternate from layer 0; Gemma 3 has one full layer in every
            # sliding_window_pattern (6), the last of each group.
            pattern = 2 if arch.windows == "alternating" else int(cfg.get("sliding_window_pattern", 6))
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        if len(layer_types) != num_layers:
            raise ArchConfigError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return tuple(None for _ in range(num_layers))


def gemma_fields(cfg: dict[str, Any], arch: Architecture) -> dict[str, Any]:
    """query_pre_attn_scalar and the soft-caps (Gemma 3 reads but, like transformers and
    vLLM, does not apply an attention soft-cap)."""
    if not arch.gemma:
        return {}
    if cfg.get("use_bidirectional_attention"):
        raise ArchConfigError("unsupported use_bidirectional_attention (an embedding model, not a decoder)")
    attn_default, final_default = arch.softcap_defaults
    attn_cap = cfg.get("attn_logit_softcapping", attn_default) if arch.attention_softcap else None
    final_cap = cfg.get("final_logit_softcapping", final_default)
    return {"query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
            "attn_logit_softcap": float(attn_cap) if attn_cap else None,
            "final_logit_softcap": float(final_cap) if final_cap else None}


def hidden_act(cfg: dict[str, Any], arch: Architecture) -> str:
    if arch.gemma:
        return cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    return cfg.get("hidden_act", "silu")
