"""Export the decoder to ONNX over packed tokens (the in-flight batching layout).

Inputs: input_ids [T], positions [T], slot_mapping [T], block_tables [B, M], seq_lens [B],
query_start_loc [B+1], logits_indices [R], k_scales / v_scales [layers], then one K and
one V pool per layer, k_pool_<i> / v_pool_<i> [blocks, block_size, kv_heads, head_dim]
(separate inputs, so a plugin can write each in place). Token, sequence, block-table and
pool-size dimensions are dynamic. Output: logits [R, V].

Linears of an FP8 build become FP8 Q/DQ: QuantizeLinear/DequantizeLinear of the
activation with its calibrated per-tensor scale, and a DequantizeLinear of the FP8
weight initializer with its per-output-channel scale (the pattern TensorRT fuses into
an FP8 GEMM).

Two variants of the same graph:
- "plugin": attention is one custom node per layer, `paged_llm::PagedAttention`, with
  the attributes TensorRT's ONNX parser uses to find a plugin (plugin_namespace,
  plugin_version, aot). Its outputs are the attention output and the two pools, which the
  plugin declares as aliases of its pool inputs: it writes this step's K/V in place.
- "reference": the same attention in standard ONNX ops (gathers through the block
  tables, masked softmax), returning the updated pools as outputs k_pool_<i>_out /
  v_pool_<i>_out, so onnxruntime on CPU can run it (tests, and the onnxruntime model
  runner of the engine).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from backend.attention.metadata import AttentionMetadata, KVCacheLayer
# The graph's interface lives with the runtime that executes it; re-exported here.
from backend.engine.runner.graph_contract import INPUT_NAMES, onnxruntime_session, output_names, pool_names  # noqa: F401
from backend.models.fp8 import FP8Linear
from backend.models.llama import CausalLM

PLUGIN_NAMESPACE = "paged_llm"
PLUGIN_NAME = "PagedAttention"
PLUGIN_VERSION = "1"
VARIANTS = ("plugin", "reference")


class ExportPagedAttention:
    """Attention backend used only while exporting (same interface as the others)."""

    variant = "reference"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: Optional[int] = None) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.updated: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def forward(self, q, k, v, cache: KVCacheLayer, meta: AttentionMetadata,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """sinks: [num_heads] attention-sink logits (gpt-oss), or None."""
        if self.variant == "plugin":
            # The node always has its sinks input (the plugin's arity is fixed): zeros, unread,
            # without sinks.
            node_sinks = sinks if sinks is not None else torch.zeros(self.num_heads, dtype=q.dtype)
            out, _, _ = torch.onnx.ops.symbolic_multi_out(
                f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}",
                (q, k, v, cache.key, cache.value, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                 meta.query_start_loc, cache.k_scale, cache.v_scale, node_sinks),
                attrs=self.plugin_attributes(int(cache.key.shape[1]), sinks is not None),
                dtypes=(q.dtype, cache.key.dtype, cache.value.dtype),
                shapes=(q.shape, cache.key.shape, cache.value.shape), version=1)
            return out
        return self._reference(q, k, v, cache, meta, sinks)

    def plugin_attributes(self, block_size: int, has_sinks: bool = False) -> dict:
        return {"num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "block_size": block_size, "scale": float(self.scale),
                "sliding_window": int(self.sliding_window or 0), "has_sinks": int(has_sinks),
                "plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": PLUGIN_VERSION, "aot": 1}

    def _reference(self, q, k, v, cache: KVCacheLayer, meta: AttentionMetadata,
                   sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
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
        if sinks is not None:
            # gpt-oss: each head's sink logit joins the softmax's normalization, then is dropped.
            sink = sinks.to(scores.dtype).reshape(1, kvh, group, 1).expand(T, kvh, group, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        return torch.einsum("tkgl,tlkd->tkgd", probs, values).reshape(T, self.num_heads, d)


class QDQLinear(nn.Module):
    """An FP8Linear as ONNX Q/DQ nodes: same FP8 weight bytes and scales, same numerics
    (activation rounded through E4M3 with its scale, weight dequantized per channel)."""

    def __init__(self, lin: FP8Linear) -> None:
        super().__init__()
        if lin.input_scale is None:
            raise ValueError("FP8 with dynamic activation scales has no static Q/DQ graph: export a build with "
                             "activation_scheme static")
        self.weight = lin.weight
        self.weight_scale = lin.weight_scale
        self.input_scale = lin.input_scale
        self.bias = lin.bias
        # QuantizeLinear's output type is its zero point's: an FP8 zero makes it E4M3.
        self.register_buffer("zero_point", torch.zeros((), dtype=torch.float8_e4m3fn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sym = torch.onnx.ops.symbolic
        xq = sym("::QuantizeLinear", (x, self.input_scale, self.zero_point), attrs={"saturate": 1},
                 dtype=torch.float8_e4m3fn, shape=x.shape, version=21)
        xd = sym("::DequantizeLinear", (xq, self.input_scale), attrs={}, dtype=x.dtype, shape=x.shape, version=21)
        w = sym("::DequantizeLinear", (self.weight, self.weight_scale), attrs={"axis": 0}, dtype=x.dtype,
                shape=self.weight.shape, version=21)
        y = xd @ w.t()
        return y if self.bias is None else y + self.bias.to(y.dtype)


def swap_in_qdq_linears(model: nn.Module) -> int:
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FP8Linear):
                setattr(parent, name, QDQLinear(child))
                swapped += 1
    return swapped


class PackedDecoder(nn.Module):
    """CausalLM over explicit packed-token tensors, for export."""

    def __init__(self, model: CausalLM, variant: str) -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        self.model = model
        self.variant = variant
        self.attns = [layer.self_attn.attn for layer in model.model.layers]
        for a in self.attns:
            assert isinstance(a, ExportPagedAttention)
            a.variant = variant

    def forward(self, input_ids, positions, slot_mapping, block_tables, seq_lens, query_start_loc,
                logits_indices, k_scales, v_scales, *pools):
        meta = AttentionMetadata(query_start_loc, seq_lens, block_tables, slot_mapping,
                                 query_lens_cpu=[], seq_lens_cpu=[], max_query_len=0, max_seq_len=0)
        caches = [KVCacheLayer(pools[2 * i], pools[2 * i + 1], k_scales[i], v_scales[i])
                  for i in range(len(self.attns))]
        hidden = self.model(input_ids, positions, caches, meta)
        logits = self.model.compute_logits(hidden[logits_indices])
        if self.variant == "plugin":
            return logits
        return (logits, *[t for a in self.attns for t in a.updated])


def load_for_export(checkpoint: str) -> CausalLM:
    """The model in fp32 with export attention; FP8 linears of an FP8 build become Q/DQ."""
    from backend.models.config import load_model_config
    from backend.models.loader import load_model
    cfg = load_model_config(checkpoint)
    model = load_model(checkpoint, cfg, torch.float32, torch.device("cpu"), ExportPagedAttention,
                       cfg.max_position_embeddings)
    swap_in_qdq_linears(model)
    return model


def example_inputs(model: CausalLM, num_blocks: int = 16, block_size: int = 16, kv_fp8: bool = False) -> tuple:
    """A mixed step: one decode, one fresh prefill, one chunk after a cached prefix.
    FP8 pools are raw E4M3 bytes (uint8), the form the plugin's kernel reads."""
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
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    pools = [torch.randn(shape, generator=g) for _ in range(2 * cfg.num_layers)]
    if kv_fp8:
        pools = [p.to(torch.float8_e4m3fn).view(torch.uint8) for p in pools]
    return (torch.tensor(ids), torch.tensor(pos), torch.tensor(slots),
            torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            torch.tensor([c + n for c, n in seqs], dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32),
            torch.tensor(idx), torch.ones(cfg.num_layers), torch.ones(cfg.num_layers), *pools)


def export(checkpoint: str, path: str, variant: str = "plugin", kv_fp8: bool = False, block_size: int = 16) -> str:
    """The block size is fixed in the graph (a plugin attribute): export with the
    engine's."""
    if kv_fp8 and variant != "plugin":
        raise ValueError("an FP8 KV cache is exported for the plugin only (the reference variant is fp32)")
    model = load_for_export(checkpoint)
    wrapper = PackedDecoder(model, variant).eval()
    args = example_inputs(model, block_size=block_size, kv_fp8=kv_fp8)
    T, B, M, R, N = (torch.export.Dim(n, min=1, max=m) for n, m in
                     (("tokens", 65536), ("seqs", 4096), ("max_blocks", 65536), ("rows", 4096),
                      ("num_blocks", 1 << 24)))
    L = model.config.num_layers
    dynamic = ({0: T}, {0: T}, {0: T}, {0: B, 1: M}, {0: B}, {0: B + 1}, {0: R}, None, None,
               tuple({0: N} for _ in range(2 * L)))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with torch.no_grad():
        prog = torch.onnx.export(wrapper, args, dynamo=True, dynamic_shapes=dynamic,
                                 input_names=INPUT_NAMES + pool_names(L), output_names=output_names(L, variant),
                                 opset_version=21, optimize=False)
    prog.save(path)
    return path
