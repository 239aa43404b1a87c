"""IBM Granite (3.x dense: GraniteForCausalLM) over the Llama-style decoder.

What differs from Llama, each as transformers' Granite modules compute it, from four
scalars of config.json (1.0 when absent, as GraniteConfig defaults them):
- embeddings times embedding_multiplier;
- attention scores scaled by attention_multiplier instead of head_dim**-0.5;
- each attention and MLP output times residual_multiplier before its residual add;
- logits divided by logits_scaling.
No weight differs, so loading, sharding and every weight format are Llama's.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from backend.attention.metadata import AttentionMetadata, KVCacheLayer
from backend.models.config import ModelConfig
from backend.models.llama import CausalLM, DecoderLayer
from backend.models.rotary import RotaryEmbedding


def _multiplier(cfg: ModelConfig, name: str) -> float:
    return float(cfg.hf_config.get(name, 1.0))


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, attn_factory: Callable[..., object], *args) -> None:
        scale = _multiplier(cfg, "attention_multiplier")

        def scaled(**kwargs):
            return attn_factory(**{**kwargs, "scale": scale})
        super().__init__(cfg, layer_idx, scaled, *args)
        self.residual_multiplier = _multiplier(cfg, "residual_multiplier")

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor], positions: torch.Tensor,
                rotary: RotaryEmbedding, cache: KVCacheLayer,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """As DecoderLayer's: (this layer's scaled MLP output, the residual stream before it)."""
        m = self.residual_multiplier
        norm = self.input_layernorm
        h, residual = self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        h = self.self_attn(h, positions, rotary, cache, meta) * m
        norm = self.post_attention_layernorm
        h, residual = self.ops.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(h) * m, residual


class GraniteCausalLM(CausalLM):
    layer_cls = GraniteDecoderLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * _multiplier(self.config, "embedding_multiplier")

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        logits = super().compute_logits(hidden)
        return None if logits is None else logits / _multiplier(self.config, "logits_scaling")
