"""The architecture facts the engine needs, read from a checkpoint's config.json."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from backend.models import arch_config
from backend.models.architectures import ARCHITECTURES
from backend.models.quant_linears import describe as describe_quantization
from backend.models.moe_config import MoEConfig, moe_config_from_dict

# Hugging Face architecture name -> family (the table: backend/models/architectures.py).
SUPPORTED_ARCHITECTURES = {name: entry.family for name, entry in ARCHITECTURES.items()}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: Optional[dict[str, Any]]
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    mlp_bias: bool
    hidden_act: str
    torch_dtype: str
    # Per layer: None for full attention, else the window length.
    sliding_windows: tuple[Optional[int], ...]
    eos_token_ids: tuple[int, ...] = field(default=())
    # config.json's quantization_config (the weight format that reads it: backend/models/quant_linears.py).
    quantization: Optional[dict[str, Any]] = None
    # o_proj's bias: Llama / Qwen3 with attention_bias (Hugging Face gives every attention
    # projection a bias then); Qwen2 has one on q/k/v only.
    o_bias: bool = False
    # Mixture-of-experts layers (backend/models/moe.py); None for dense models.
    moe: Optional[MoEConfig] = None
    # Gemma (backend/models/arch_config.py): scores scaled by query_pre_attn_scalar**-0.5
    # instead of head_dim**-0.5; tanh soft-caps on attention scores and final logits;
    # Gemma 3's RoPE base on its sliding layers.
    query_pre_attn_scalar: Optional[float] = None
    attn_logit_softcap: Optional[float] = None
    final_logit_softcap: Optional[float] = None
    local_rope_theta: Optional[float] = None
    # Channels of each head that RoPE rotates (partial_rotary_factor); None: all.
    rotary_dim: Optional[int] = None
    # gpt-oss: a learned logit per attention head in every softmax's denominator
    # (`self_attn.sinks`, [num_heads]).
    attention_sinks: bool = False
    # The checkpoint's expert weights are MXFP4 (`quant_method: mxfp4`, gpt-oss as
    # published): dequantized exactly at load (backend/ops/mxfp4.py).
    mxfp4_experts: bool = False
    # config.json as read: a model class takes what only its family has from here
    # (Granite's multipliers), so a new architecture needs no field above.
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, in elements (multiply by the element size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _as_list(v: Any) -> list[int]:
    if v is None:
        return []
    return list(v) if isinstance(v, (list, tuple)) else [v]


def load_model_config(path: str) -> ModelConfig:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise UnsupportedModelError(f"no config.json in checkpoint folder '{path}'")
    with open(cfg_path) as f:
        cfg = json.load(f)
    eos: list[int] = []
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = _as_list(json.load(f).get("eos_token_id"))
    return model_config_from_dict(cfg, eos)


def _full_text_config(text: dict[str, Any]) -> dict[str, Any]:
    """A vision-language checkpoint's text_config with its model type's defaults filled
    in (published LLaVA configs state only what differs from LlamaConfig's)."""
    if "hidden_size" in text or "model_type" not in text:
        return text
    from transformers import CONFIG_MAPPING
    try:
        defaults = CONFIG_MAPPING[text["model_type"]]().to_dict()
    except KeyError:
        return text
    return {**defaults, **text}


def model_config_from_dict(cfg: dict[str, Any], generation_eos: Optional[list[int]] = None) -> ModelConfig:
    """A checkpoint's config.json, already parsed; generation_config.json's EOS ids win."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"unsupported architecture {archs!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    entry = ARCHITECTURES[arch]
    if entry.vision:
        # A vision-language checkpoint: the decoder's fields are in text_config
        # (transformers >= 5) or at the top (the published ones); the top level keeps
        # vision_config and the image token ids.
        cfg = {**cfg, **_full_text_config(cfg.get("text_config") or {}), "architectures": archs}

    num_heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    num_layers = cfg["num_hidden_layers"]

    try:
        rope = arch_config.rope_fields(cfg, entry)
        windows = arch_config.sliding_windows(cfg, entry, num_layers)
        gemma = arch_config.gemma_fields(cfg, entry)
    except arch_config.ArchConfigError as e:
        raise UnsupportedModelError(str(e)) from None

    head_dim = cfg.get("head_dim") or hidden // num_heads
    rotary_dim = int(head_dim * rope["partial_rotary_factor"])
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise UnsupportedModelError(f"unsupported partial_rotary_factor {rope['partial_rotary_factor']} "
                                    f"(RoPE over {rotary_dim} of {head_dim} channels)")
    qk_norm = entry.qk_norm
    if rotary_dim < head_dim and qk_norm:
        raise UnsupportedModelError("unsupported partial_rotary_factor with q/k norms")

    eos = generation_eos or _as_list(cfg.get("eos_token_id"))

    quant = cfg.get("quantization_config")
    mxfp4 = quant is not None and quant.get("quant_method") == "mxfp4"
    if mxfp4:
        if not entry.mxfp4_experts:
            raise UnsupportedModelError(f"quantization_config.quant_method 'mxfp4' is read for gpt-oss only, not {arch}")
        quant = None        # dequantized at load: the model runs in the compute dtype
    if quant is not None:
        try:
            describe_quantization(quant)    # a format reads it (backend/models/quant_linears.py)
        except ValueError as e:             # the format's own error names the field
            raise UnsupportedModelError(f"unsupported quantization_config: {e}") from None
    # MoE: only our FP8 builds of Mixtral / Qwen-MoE (backend/models/moe_fp8.py).
    fp8_moe_build = (not entry.mxfp4_experts and quant is not None
                     and quant.get("quant_method") == "paged_llm_fp8")
    moe = moe_config_from_dict(cfg, entry.moe, num_layers)
    if quant is not None and moe is not None and not fp8_moe_build:
        raise UnsupportedModelError(f"quantized mixture-of-experts checkpoints ({arch}, "
                                    f"{quant.get('quant_method')}) are not supported yet: use the bf16 weights, or "
                                    "build FP8 ones with `python -m builder build --weights fp8`")

    # GptOssConfig defaults attention_bias to true (every projection has one).
    attention_bias = bool(cfg.get("attention_bias", entry.attention_bias))
    hidden_act = arch_config.hidden_act(cfg, entry)
    if hidden_act not in ("silu", "gelu", "gelu_pytorch_tanh"):
        raise UnsupportedModelError(f"unsupported hidden_act '{hidden_act}'")

    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rope_theta=rope["rope_theta"],
        rope_scaling=rope["rope_scaling"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", entry.tied_by_default)),
        qkv_bias=(entry.qkv_bias == "always" or (entry.qkv_bias == "config" and bool(cfg.get("qkv_bias", True)))
                  or attention_bias),
        qk_norm=qk_norm,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        hidden_act=hidden_act,
        torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        sliding_windows=windows,
        eos_token_ids=tuple(eos),
        quantization=quant,
        o_bias=attention_bias,
        moe=moe,
        local_rope_theta=rope["local_rope_theta"],
        rotary_dim=rotary_dim if rotary_dim < head_dim else None,
        attention_sinks=entry.attention_sinks,
        mxfp4_experts=mxfp4,
        hf_config=dict(cfg),
        **gemma,
    )
