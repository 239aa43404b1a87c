"""Which model class serves a family (ModelConfig.family); the Llama-style decoder
unless a family needs its own layers."""

from __future__ import annotations

from backend.models.config import ModelConfig
from backend.models.llama import CausalLM


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    if cfg.family in ("gemma2", "gemma3"):
        from backend.models.gemma import GemmaCausalLM
        return GemmaCausalLM
    if cfg.family == "gpt_oss":
        from backend.models.gpt_oss import GptOssCausalLM
        return GptOssCausalLM
    return CausalLM
