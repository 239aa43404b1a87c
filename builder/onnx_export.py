"""Export the decoder to ONNX over packed tokens (the in-flight batching layout).

Inputs: input_ids [T], positions [T], slot_mapping [T], block_tables [B, M], seq_lens [B],
query_start_loc [B+1], logits_indices [R], k_pools / v_pools [layers, blocks, block_size,
kv_heads, head_dim] and their scales k_scales / v_scales [layers]. Outputs: logits [R, V].

Two variants of the same graph:
- "plugin": attention is one custom node per layer, `paged_llm::PagedAttention`, with the
  attributes TensorRT's ONNX parser uses to find a plugin (plugin_namespace,
  plugin_version). The plugin writes this step's K/V into the pools in place.
- "reference": the same attention written in standard ONNX ops (gathers through the
  block tables, masked softmax), returning the updated pools as extra outputs, so that
  onnxruntime on CPU can check the export against the torch model.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from backend.attention.metadata import AttentionMetadata, KVCacheLayer
from backend.models.llama import CausalLM

PLUGIN_NAMESPACE = "paged_llm"
PLUGIN_VERSION = "1"


class ExportPagedAttention:
    """Attention backend used only while exporting (same interface as the others)."""

    variant = "reference"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: Optional[int] = None) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.updated: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def forward(self, q, k, v, cache: KVCacheLayer, meta: AttentionMetadata) -> torch.Tensor:
        if self.variant == "plugin":
            return torch.onnx.ops.symbolic(
                f"{PLUGIN_NAMESPACE}::PagedAttention",
                (q, k, v, cache.key, cache.value, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                 meta.query_start_loc, cache.k_scale, cache.v_scale),
                attrs={"num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                       "block_size": int(cache.key.shape[1]), "scale": float(self.scale),
                       "sliding_window": int(self.sliding_window or 0),
                       "plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": PLUGIN_VERSION},
                dtype=q.dtype, shape=q.shape, version=1)
        return self._reference(q, k, v, cache, meta)

    def _reference(self, q, k, v, cache: KVCacheLayer, meta: AttentionMetadata) -> torch.Tensor:
        T = q.shape[0]
        kvh, d, bs = self.num_kv_heads, self.head_dim, cache.key.shape[1]
        group = self.num_heads // kvh
        k_flat = cache.key.reshape(-1, kvh, d).index_put((meta.slot_mapping,), k / cache.k_scale)
        v_flat = cache.value.reshape(-1, kvh, d).index_put((meta.slot_mapping,), v / cache.v_scale)
        self.updated = (k_flat.reshape(cache.key.shape), v_flat.reshape(cache.value.shape))
        tok = torch.arange(T, device=q.device)
        qsl = meta.query_start_loc
        # Sequence of each token: how many sequences end at or before it.
        token_seq = (tok[:, None] >= qsl[1:][None, :]).sum(dim=1)
        q_start = qsl[token_seq]
        q_len = qsl[token_seq + 1] - q_start
        pos = meta.seq_lens[token_seq] - q_len + (tok - q_start)             # [T]
        j = torch.arange(meta.block_tables.shape[1] * bs, device=q.device)   # key positions
        slots = meta.block_tables[token_seq][:, j // bs].long() * bs + (j % bs)[None, :]
        keys = k_flat[slots] * cache.k_scale                                  # [T, L, KVH, D]
        values = v_flat[slots] * cache.v_scale
        allowed = j[None, :] <= pos[:, None]
        if self.sliding_window:
            allowed = allowed & (j[None, :] > pos[:, None] - self.sliding_window)
        qg = q.reshape(T, kvh, group, d)
        scores = torch.einsum("tkgd,tlkd->tkgl", qg, keys) * self.scale
        scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("tkgl,tlkd->tkgd", probs, values).reshape(T, self.num_heads, d)


class PackedDecoder(nn.Module):
    """CausalLM over explicit packed-token tensors, for export."""

    def __init__(self, model: CausalLM, variant: str) -> None:
        super().__init__()
        self.model = model
        self.variant = variant
        self.attns = [layer.self_attn.attn for layer in model.model.layers]
        for a in self.attns:
            assert isinstance(a, ExportPagedAttention)
            a.variant = variant

    def forward(self, input_ids, positions, slot_mapping, block_tables, seq_lens, query_start_loc,
                logits_indices, k_pools, v_pools, k_scales, v_scales):
        meta = AttentionMetadata(query_start_loc, seq_lens, block_tables, slot_mapping,
                                 query_lens_cpu=[], seq_lens_cpu=[], max_query_len=0, max_seq_len=0)
        caches = [KVCacheLayer(k_pools[i], v_pools[i], k_scales[i], v_scales[i]) for i in range(len(self.attns))]
        hidden = self.model(input_ids, positions, caches, meta)
        logits = self.model.compute_logits(hidden[logits_indices])
        if self.variant == "plugin":
            return logits
        return (logits, torch.stack([a.updated[0] for a in self.attns]),
                torch.stack([a.updated[1] for a in self.attns]))


INPUT_NAMES = ["input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc",
               "logits_indices", "k_pools", "v_pools", "k_scales", "v_scales"]


def load_for_export(checkpoint: str) -> CausalLM:
    from backend.models.config import load_model_config
    from backend.models.loader import load_model
    cfg = load_model_config(checkpoint)
    return load_model(checkpoint, cfg, torch.float32, torch.device("cpu"), ExportPagedAttention,
                      cfg.max_position_embeddings)


def example_inputs(model: CausalLM, num_blocks: int = 16, block_size: int = 4) -> tuple:
    """A mixed step: one decode, one fresh prefill, one chunk after a cached prefix."""
    cfg = model.config
    seqs = [(9, 1), (0, 5), (8, 3)]           # (cached tokens, new tokens)
    g = torch.Generator().manual_seed(0)
    tables, next_block = [], 0
    for c, n in seqs:
        k = -(-(c + n) // block_size)
        tables.append(list(range(next_block, next_block + k)))
        next_block += k
    width = max(len(t) for t in tables)
    ids, pos, slots, qsl, idx = [], [], [], [0], []
    for (c, n), t in zip(seqs, tables):
        ids += torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()
        pos += list(range(c, c + n))
        slots += [t[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
        qsl.append(qsl[-1] + n)
        idx.append(qsl[-1] - 1)
    shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return (torch.tensor(ids), torch.tensor(pos), torch.tensor(slots),
            torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            torch.tensor([c + n for c, n in seqs], dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32),
            torch.tensor(idx), torch.randn(shape, generator=g), torch.randn(shape, generator=g),
            torch.ones(cfg.num_layers), torch.ones(cfg.num_layers))


def export(checkpoint: str, path: str, variant: str = "plugin") -> str:
    model = load_for_export(checkpoint)
    wrapper = PackedDecoder(model, variant).eval()
    args = example_inputs(model)
    T, B, M, R = (torch.export.Dim(n, min=1, max=m) for n, m in
                  (("tokens", 65536), ("seqs", 4096), ("max_blocks", 65536), ("rows", 4096)))
    dynamic = {"input_ids": {0: T}, "positions": {0: T}, "slot_mapping": {0: T}, "block_tables": {0: B, 1: M},
               "seq_lens": {0: B}, "query_start_loc": {0: B + 1}, "logits_indices": {0: R},
               "k_pools": None, "v_pools": None, "k_scales": None, "v_scales": None}
    outputs = ["logits"] if variant == "plugin" else ["logits", "k_pools_out", "v_pools_out"]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with torch.no_grad():
        prog = torch.onnx.export(wrapper, args, dynamo=True, dynamic_shapes=dynamic, input_names=INPUT_NAMES,
                                 output_names=outputs, opset_version=21, optimize=False)
    prog.save(path)
    return path
