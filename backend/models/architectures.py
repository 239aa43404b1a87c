"""The architectures we serve: Hugging Face's `architectures` name -> the family it
reads as (ModelConfig.family) and the class that serves it, by module and class name
inside backend/models (imported when a model of that class loads, as vLLM's registry
does, so that reading a config.json imports no model code).

A new architecture: its model file (a CausalLM subclass that reads whatever else it
needs from ModelConfig.hf_config) and a line here. docs/development.md walks through one.
"""

from __future__ import annotations

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


_GEMMA = dict(tied_by_default=True)
_GPT_OSS = dict(attention_bias=True, attention_sinks=True, mxfp4_experts=True)

ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama", "llama", "CausalLM"),
    "MistralForCausalLM": Architecture("mistral", "llama", "CausalLM"),
    "Qwen2ForCausalLM": Architecture("qwen2", "llama", "CausalLM", qkv_bias="always"),
    "Qwen3ForCausalLM": Architecture("qwen3", "llama", "CausalLM", qk_norm=True),
    "MixtralForCausalLM": Architecture("mixtral", "llama", "CausalLM"),
    "Qwen2MoeForCausalLM": Architecture("qwen2_moe", "llama", "CausalLM", qkv_bias="config"),
    "Qwen3MoeForCausalLM": Architecture("qwen3_moe", "llama", "CausalLM", qk_norm=True),
    "Gemma2ForCausalLM": Architecture("gemma2", "gemma", "GemmaCausalLM", **_GEMMA),
    "Gemma3ForCausalLM": Architecture("gemma3", "gemma", "GemmaCausalLM", qk_norm=True, **_GEMMA),
    "Phi3ForCausalLM": Architecture("phi3", "llama", "CausalLM", single_rank="its fused qkv_proj / gate_up_proj "
                                    "checkpoint tensors are not split across ranks yet"),
    "GptOssForCausalLM": Architecture("gpt_oss", "gpt_oss", "GptOssCausalLM", **_GPT_OSS),
    "GraniteForCausalLM": Architecture("granite", "granite", "GraniteCausalLM"),
    "Olmo2ForCausalLM": Architecture("olmo2", "olmo2", "Olmo2CausalLM",
                                     single_rank="its q/k norms span every head: not split across ranks yet"),
}
