"""OLMo 2 (Olmo2ForCausalLM) over the Llama-style decoder.

What differs from Llama, each as transformers' Olmo2 modules compute it:
- q and k are RMS-normed over the whole projection, every head at once (weights
  [heads * head_dim] and [kv_heads * head_dim]), before RoPE;
- the norms come after, not before: no input norm; the attention and the MLP outputs
  are normed (post_attention_layernorm, post_feedforward_layernorm), then added to the
  residual stream.
One rank only: the q/k norms' statistics span every head (the table says so).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from backend.attention.metadata import AttentionMetadata, KVCacheLayer
from backend.models.config import ModelConfig
from backend.models.llama import Attention, CausalLM, DecoderLayer, RMSNorm
from backend.models.rotary import RotaryEmbedding
from backend.ops import LayerOps
from backend.parallel.group import TensorParallel


class Olmo2Attention(Attention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, attn_factory: Callable[..., object], ops: LayerOps,
                 tp: TensorParallel) -> None:
        super().__init__(cfg, layer_idx, attn_factory, ops, tp)
        self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                cache: KVCacheLayer, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        norm = self.ops.add_rms_norm
        q = norm(qkv[:, :q_end].contiguous(), None, self.q_norm.weight, self.q_norm.eps)[0]
        k = norm(qkv[:, q_end:k_end].contiguous(), None, self.k_norm.weight, self.k_norm.eps)[0]
        v = qkv[:, k_end:].view(T, self.num_kv_heads, self.head_dim)
        q, k = self.ops.rotary(positions, q.view(T, self.num_heads, self.head_dim),
                               k.view(T, self.num_kv_heads, self.head_dim), rotary.cos_cache, rotary.sin_cache,
                               None, None, 0.0)
        o = self.attn.forward(q, k, v, cache, meta)
        return self.tp.all_reduce(self.o_proj(o.reshape(T, self.q_size)))


class Olmo2DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, attn_factory: Callable[..., object], ops: LayerOps,
                 tp: TensorParallel) -> None:
        super().__init__(cfg, layer_idx, attn_factory, ops, tp)
        self.self_attn = Olmo2Attention(cfg, layer_idx, attn_factory, ops, tp)
        del self.input_layernorm                    # (no input norm: its checkpoint has none)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor], positions: torch.Tensor,
                rotary: RotaryEmbedding, cache: KVCacheLayer,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """As DecoderLayer's: (this layer's normed MLP output, the residual stream before
        it); the next layer adds them."""
        stream = x if residual is None else x + residual
        norm = self.post_attention_layernorm
        h = self.ops.add_rms_norm(self.self_attn(stream, positions, rotary, cache, meta), None, norm.weight,
                                  norm.eps)[0]
        stream = stream + h
        norm = self.post_feedforward_layernorm
        return self.ops.add_rms_norm(self.mlp(stream), None, norm.weight, norm.eps)[0], stream


class Olmo2CausalLM(CausalLM):
    layer_cls = Olmo2DecoderLayer
