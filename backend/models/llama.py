"""Llama-family decoder over packed tokens: Llama (incl. Llama 3 rope scaling), Mistral,
Qwen2 (qkv bias, tied embeddings) and Qwen3 (q/k RMSNorm).

q/k/v are one `qkv_proj` and gate/up one `gate_up_proj` (fused at weight load,
backend/models/loader.py), so a layer runs three GEMMs fewer. The residual travels
beside the hidden state and each norm adds it first (vLLM's layout), so the add and the
norm are one kernel. The math follows Hugging Face's modules operation for operation,
which is what makes greedy output match token for token in fp32.

Under tensor parallelism (backend/parallel/) each rank builds the model from its local
config (its heads, KV heads and MLP channels): o_proj and down_proj outputs are summed
over the ranks, and the embedding and LM head hold a slice of the vocabulary each.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from backend.attention.metadata import AttentionMetadata, KVCacheLayer
from backend.models.config import ModelConfig
from backend.models.moe import SparseMoeBlock
from backend.models.rotary import RotaryEmbedding
from backend.ops import LayerOps, make_layer_ops
from backend.parallel.group import SINGLE, TensorParallel


class RMSNorm(nn.Module):
    """Holds the weight (checkpoint name `<norm>.weight`); the math is LayerOps'."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, attn_factory: Callable[..., object], ops: LayerOps,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        h = cfg.hidden_size
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.ops = ops
        # gpt-oss: a learned logit per head in the softmax denominator (this rank's heads).
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False) if cfg.attention_sinks else None
        # Gemma scales scores by query_pre_attn_scalar**-0.5 and may soft-cap them
        # (passed only when set, so backends without the option serve the others).
        extra = {"logits_soft_cap": cfg.attn_logit_softcap} if cfg.attn_logit_softcap else {}
        self.attn = attn_factory(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            scale=(cfg.query_pre_attn_scalar or self.head_dim) ** -0.5,
            sliding_window=cfg.sliding_windows[layer_idx], **extra)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                cache: KVCacheLayer, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        # Views into the one GEMM output; the kernels take their strides.
        q = qkv[:, :self.q_size].view(T, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else (None, None, 0.0)
        q, k = self.ops.rotary(positions, q, k, rotary.cos_cache, rotary.sin_cache, *norms)
        o = self.attn.forward(q, k, v, cache, meta) if self.sinks is None else \
            self.attn.forward(q, k, v, cache, meta, sinks=self.sinks)
        return self.tp.all_reduce(self.o_proj(o.reshape(T, self.q_size)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: LayerOps, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = cfg.hidden_act
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.ops.act_and_mul(self.gate_up_proj(x), self.act)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, attn_factory: Callable[..., object], ops: LayerOps,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, attn_factory, ops, tp)
        sparse = cfg.moe is not None and cfg.moe.sparse_layers[layer_idx]
        self.mlp = SparseMoeBlock(cfg, ops, tp) if sparse else MLP(cfg, ops, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor], positions: torch.Tensor,
                rotary: RotaryEmbedding, cache: KVCacheLayer,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it): the next
        norm adds them."""
        norm = self.input_layernorm
        h, residual = self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        h = self.self_attn(h, positions, rotary, cache, meta)
        norm = self.post_attention_layernorm
        h, residual = self.ops.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(h), residual


class VocabParallelEmbedding(nn.Embedding):
    """Rank r holds rows [r * n, (r + 1) * n); ids outside give zeros and the ranks'
    lookups are summed."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        rows = -(-vocab_size // tp.size)
        super().__init__(rows, hidden_size)
        self.tp, self.rows = tp, rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.tp.rank * self.rows
        outside = (local < 0) | (local >= self.rows)
        x = super().forward(local.masked_fill(outside, 0))
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0.0))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_factory: Callable[..., object], ops: LayerOps,
                 tp: TensorParallel, layer_cls: type = DecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(layer_cls(cfg, i, attn_factory, ops, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    layer_cls: type = DecoderLayer
    # Parameters (by name suffix) the loader leaves in fp32 whatever the compute dtype.
    fp32_params: tuple[str, ...] = ()
    # EAGLE-3 (backend/models/eagle3.py) reads the residual stream entering these layers:
    # each forward leaves them concatenated ([T, len * hidden]) in `captured_hidden`.
    aux_hidden_layers: frozenset[int] = frozenset()
    # Medusa (backend/models/medusa.py) reads the final hidden states: each forward leaves
    # them ([T, hidden]) in `captured_hidden`.
    capture_final_hidden: bool = False
    captured_hidden: Optional[torch.Tensor] = None

    def __init__(self, cfg: ModelConfig, attn_factory: Callable[..., object],
                 max_position: Optional[int] = None, ops: Optional[LayerOps] = None,
                 tp: TensorParallel = SINGLE) -> None:
        """cfg: this rank's shapes (backend.parallel.sharding.local_config); the
        vocabulary stays whole in it and is split here."""
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.ops = ops or make_layer_ops("torch")
        self.model = DecoderModel(cfg, attn_factory, self.ops, tp, self.layer_cls)
        self.lm_head = nn.Linear(cfg.hidden_size, self.model.embed_tokens.rows, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.build_buffers(max_position or cfg.max_position_embeddings)

    def build_buffers(self, max_position: int) -> None:
        """Tables that are not weights (RoPE); the loader calls this again after loading,
        since the model was built on the meta device."""
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.rope_dim, max_position, cfg.rope_theta, cfg.rope_scaling)

    @staticmethod
    def adapt_checkpoint(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors as this model's parameters expect them (in place)."""
        return state

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def rotary_for(self, layer_idx: int) -> RotaryEmbedding:
        return self.rotary

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCacheLayer], meta: AttentionMetadata,
                inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm. inputs_embeds: the step's
        embeddings when a subclass made them (image tokens: qwen2_vl.py)."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        aux = self.aux_hidden_layers
        captured = []
        for i, (layer, cache) in enumerate(zip(self.model.layers, kv_caches)):
            if i in aux:        # (in layer order, as vLLM concatenates them)
                captured.append(x if residual is None else x + residual)
            x, residual = layer(x, residual, positions, self.rotary_for(i), cache, meta)
        if captured:
            self.captured_hidden = torch.cat(captured, dim=-1)
        norm = self.model.norm
        out = self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)[0]
        if self.capture_final_hidden:
            self.captured_hidden = out
        return out

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """[R, vocab] on rank 0; None on the other ranks (their slices went to rank 0)."""
        logits = self.tp.gather_last_dim(self.lm_head(hidden))
        if logits is None or self.tp.size == 1:
            return logits
        return logits[:, :self.config.vocab_size]
