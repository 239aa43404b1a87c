"""The architectures we serve: Hugging Face's `architectures` name -> the family it
reads as (ModelConfig.family) and the class that serves it, by module and class name
inside backend/models (imported when a model of that class loads, as vLLM's registry
does, so that reading a config.json imports no model code).

A new architecture: its model file (a CausalLM subclass that reads whatever else it
needs from ModelConfig.hf_config) and a line here. docs/development.md walks through one.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple, Optional


class Architecture(NamedTuple):
    family: str
    module: str                 # backend.models.<module>
    model_class: str
    # Facts of the family that config.json does not state (the defaults of its
    # transformers config class and modules), read by backend/models/config.py:
    qk_norm: bool = False                   # RMSNorm on q and k before RoPE
    qkv_bias: str = "no"                    # "always", "config" (config.json's qkv_bias, default true), "no"
    attention_bias: bool = False            # attention_bias when config.json omits it
    tied_by_default: bool = False           # tie_word_embeddings when config.json omits it
    attention_sinks: bool = False           # a learned logit per head in every softmax (self_attn.sinks)
    mxfp4_experts: bool = False             # reads `quant_method: mxfp4` (experts dequantized at load)
    # Why it runs on one rank only (tensor parallelism refused with this reason), or None.
    single_rank: Optional[str] = None
    # RoPE (backend/models/arch_config.py): the base when config.json names none; the
    # scaling when it names none either; a second base for sliding layers (Gemma 3);
    # rope_type "yarn" read as LongRoPE (Phi-3's older name).
    rope_theta: float = 10000.0
    default_rope_scaling: Optional[dict] = None
    local_rope: bool = False
    yarn_means_longrope: bool = False
    # Which layers slide when config.json has no layer_types: "none"; "all"; "qwen" (only
    # with use_sliding_window, from max_window_layers on); "alternating" (sliding first);
    # "pattern" (one full layer closing each group of sliding_window_pattern, 6).
    windows: str = "none"
    # Gemma's extras: query_pre_attn_scalar, its soft-caps' defaults (attention, final),
    # whether the attention soft-cap applies, and its activation's key.
    gemma: bool = False
    softcap_defaults: tuple[Optional[float], Optional[float]] = (None, None)
    attention_softcap: bool = False
    # Mixture of experts (backend/models/moe_config.py): how config.json states it: "",
    # "mixtral", "qwen", "qwen_shared_expert" (Qwen2-MoE's always-on expert) or "gpt_oss".
    moe: str = ""
    # Vision-language models: the multimodal processor that reads its images
    # (backend/multimodal/registry.py); "" for text-only models.
    vision: str = ""


# gpt-oss's RoPE when config.json names none (transformers' GptOssConfig).
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
_GEMMA = dict(tied_by_default=True, gemma=True)
_GPT_OSS = dict(attention_bias=True, attention_sinks=True, mxfp4_experts=True, rope_theta=150_000.0,
                default_rope_scaling=GPT_OSS_ROPE, windows="alternating", moe="gpt_oss")

ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama", "llama", "CausalLM"),
    "MistralForCausalLM": Architecture("mistral", "llama", "CausalLM", windows="all"),
    "Qwen2ForCausalLM": Architecture("qwen2", "llama", "CausalLM", qkv_bias="always", windows="qwen"),
    "Qwen3ForCausalLM": Architecture("qwen3", "llama", "CausalLM", qk_norm=True, windows="qwen"),
    "MixtralForCausalLM": Architecture("mixtral", "llama", "CausalLM", windows="all", moe="mixtral"),
    "Qwen2MoeForCausalLM": Architecture("qwen2_moe", "llama", "CausalLM", qkv_bias="config", windows="qwen",
                                        moe="qwen_shared_expert"),
    "Qwen3MoeForCausalLM": Architecture("qwen3_moe", "llama", "CausalLM", qk_norm=True, windows="qwen", moe="qwen"),
    "Gemma2ForCausalLM": Architecture("gemma2", "gemma", "GemmaCausalLM", windows="alternating",
                                      softcap_defaults=(50.0, 30.0), attention_softcap=True, **_GEMMA),
    "Gemma3ForCausalLM": Architecture("gemma3", "gemma", "GemmaCausalLM", qk_norm=True, rope_theta=1_000_000.0,
                                      local_rope=True, windows="pattern", **_GEMMA),
    "Phi3ForCausalLM": Architecture("phi3", "llama", "CausalLM", windows="all", yarn_means_longrope=True,
                                    single_rank="its fused qkv_proj / gate_up_proj "
                                    "checkpoint tensors are not split across ranks yet"),
    "GptOssForCausalLM": Architecture("gpt_oss", "gpt_oss", "GptOssCausalLM", **_GPT_OSS),
    "GraniteForCausalLM": Architecture("granite", "granite", "GraniteCausalLM"),
    "Qwen2VLForConditionalGeneration": Architecture(
        "qwen2_vl", "qwen2_vl", "Qwen2VLCausalLM", qkv_bias="always", windows="qwen", rope_theta=1_000_000.0,
        vision="qwen2_vl", single_rank="its vision tower is not split across ranks yet"),
    "Qwen2_5_VLForConditionalGeneration": Architecture(
        "qwen2_5_vl", "qwen2_5_vl", "Qwen2_5_VLCausalLM", qkv_bias="always", windows="qwen", rope_theta=1_000_000.0,
        vision="qwen2_vl", single_rank="its vision tower is not split across ranks yet"),
    "LlavaForConditionalGeneration": Architecture(
        "llava", "llava", "LlavaCausalLM", vision="llava", single_rank="its vision tower is not split across ranks yet"),
    "Gemma3ForConditionalGeneration": Architecture(
        "gemma3_vl", "gemma3_vl", "Gemma3VLCausalLM", qk_norm=True, rope_theta=1_000_000.0, local_rope=True,
        windows="pattern", vision="gemma3", single_rank="its vision tower is not split across ranks yet", **_GEMMA),
    "Olmo2ForCausalLM": Architecture("olmo2", "olmo2", "Olmo2CausalLM",
                                     single_rank="its q/k norms span every head: not split across ranks yet"),
}


def reads_images(checkpoint: Optional[str]) -> bool:
    """Whether the checkpoint folder's architecture reads images (its `vision` entry);
    False when its config.json cannot be read."""
    try:
        with open(os.path.join(checkpoint or "", "config.json")) as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, ValueError):
        return False
    return any(ARCHITECTURES[a].vision for a in archs if a in ARCHITECTURES)
