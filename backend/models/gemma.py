"""Gemma 2 and Gemma 3 (text) over the Llama-style decoder (backend/models/llama.py).

What differs, each as transformers' Gemma2/Gemma3 modules compute it:
- RMSNorm multiplies by (1 + w): folded into the weights at load (w + 1 in fp32, then
  cast once), so the same norm kernels serve. In bf16 this rounds (1 + w) to bf16 where
  transformers multiplies in fp32 and rounds the product: a last-bit difference there,
  none in fp32.
- Sandwich norms: the attention and MLP outputs are normed (post_attention_layernorm,
  post_feedforward_layernorm) before the residual add; pre_feedforward_layernorm
  replaces Llama's post_attention_layernorm as the MLP's input norm.
- Embeddings scaled by sqrt(hidden_size), rounded to the compute dtype first.
- Scores scaled by query_pre_attn_scalar**-0.5; Gemma 2 soft-caps them
  (cap * tanh(s / cap), in the attention backends) and both soft-cap the final logits.
- Alternating sliding-window and full layers (ModelConfig.sliding_windows); Gemma 3's
  sliding layers use their own RoPE base (local_rope_theta) and it has q/k RMSNorm
  (1 + w as well) before RoPE.
- GeGLU with tanh GELU (hidden_activation), tied embeddings.
"""

from __future__ import annotations

from typing import Optional

import torch

from backend.attention.metadata import AttentionMetadata, KVCacheLayer
from backend.models.config import ModelConfig
from backend.models.llama import CausalLM, DecoderLayer, RMSNorm
from backend.models.rotary import RotaryEmbedding


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, *args) -> None:
        super().__init__(cfg, layer_idx, *args)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor], positions: torch.Tensor,
                rotary: RotaryEmbedding, cache: KVCacheLayer,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's normed MLP output, the residual stream before it), as
        DecoderLayer does: the next norm adds them."""
        ops = self.ops
        norm = self.input_layernorm
        h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        h = self.self_attn(h, positions, rotary, cache, meta)
        norm = self.post_attention_layernorm
        h = ops.add_rms_norm(h, None, norm.weight, norm.eps)[0]
        norm = self.pre_feedforward_layernorm
        h, residual = ops.add_rms_norm(h, residual, norm.weight, norm.eps)
        h = self.mlp(h)
        norm = self.post_feedforward_layernorm
        return ops.add_rms_norm(h, None, norm.weight, norm.eps)[0], residual


class GemmaCausalLM(CausalLM):
    layer_cls = GemmaDecoderLayer

    def build_buffers(self, max_position: int) -> None:
        super().build_buffers(max_position)
        cfg = self.config
        self.rotary_local = None
        if cfg.local_rope_theta is not None:
            self.rotary_local = RotaryEmbedding(cfg.rope_dim, max_position, cfg.local_rope_theta, None)
        # transformers: embeddings * tensor(sqrt(hidden)).to(weight dtype); the loader
        # casts this buffer to the compute dtype, which is that rounding.
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5), persistent=False)

    @staticmethod
    def adapt_checkpoint(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Gemma's norms compute x * (1 + w): store 1 + w (in fp32; cast later)."""
        for name in list(state):
            if name.endswith("norm.weight"):
                state[name] = state[name].float() + 1.0
        return state

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        return x * self.embed_scale.to(x.dtype)

    def rotary_for(self, layer_idx: int) -> RotaryEmbedding:
        if self.rotary_local is not None and self.config.sliding_windows[layer_idx] is not None:
            return self.rotary_local
        return self.rotary

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcap
        if logits is None or not cap:
            return logits
        return torch.tanh(logits / cap) * cap
