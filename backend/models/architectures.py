"""The architectures we serve: Hugging Face's `architectures` name -> the family it
reads as (ModelConfig.family) and the class that serves it, by module and class name
inside backend/models (imported when a model of that class loads, as vLLM's registry
does, so that reading a config.json imports no model code).

A new architecture: its model file (a CausalLM subclass that reads whatever else it
needs from ModelConfig.hf_config) and a line here. docs/development.md walks through one.
"""

from __future__ import annotations

from typing import NamedTuple


class Architecture(NamedTuple):
    family: str
    module: str                 # backend.models.<module>
    model_class: str


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama", "llama", "CausalLM"),
    "MistralForCausalLM": Architecture("mistral", "llama", "CausalLM"),
    "Qwen2ForCausalLM": Architecture("qwen2", "llama", "CausalLM"),
    "Qwen3ForCausalLM": Architecture("qwen3", "llama", "CausalLM"),
    "MixtralForCausalLM": Architecture("mixtral", "llama", "CausalLM"),
    "Qwen2MoeForCausalLM": Architecture("qwen2_moe", "llama", "CausalLM"),
    "Qwen3MoeForCausalLM": Architecture("qwen3_moe", "llama", "CausalLM"),
    "Gemma2ForCausalLM": Architecture("gemma2", "gemma", "GemmaCausalLM"),
    "Gemma3ForCausalLM": Architecture("gemma3", "gemma", "GemmaCausalLM"),
    "Phi3ForCausalLM": Architecture("phi3", "llama", "CausalLM"),
    "GptOssForCausalLM": Architecture("gpt_oss", "gpt_oss", "GptOssCausalLM"),
    "GraniteForCausalLM": Architecture("granite", "granite", "GraniteCausalLM"),
}
