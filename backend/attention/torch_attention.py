"""Paged attention in plain torch: the reference path, and the one that runs on CPU.

On CPU, decode rows go to the C++ kernel of cpu_decode.py where it applies (fp32/bf16
cache, no soft-cap or sinks) and could be built, and so do the prompt tokens of short
sequences (at most cpu_decode.PREFILL_MAX_KEYS keys). Otherwise decode rows (one query per
sequence) are batched into padded SDPA calls, by groups of similar length. Other prefill
chunks run one sequence at a time through scaled_dot_product_attention: a chunk that is
the whole sequence with SDPA's own causal mask, one after a cached context with an
explicit mask (causal within the chunk, full over the context before it).
Every path reads K/V back from the cache, so a prefix-cache hit and a fresh prefill
see exactly the same values, FP8 and INT8 caches included.

Queries with key limits (AttentionMetadata.key_limits: an image's tokens attend to the
whole image, Gemma 3) take the explicit mask with those limits for the causal bound. A
tree of proposals (AttentionMetadata.tree) hides from each query the tree's nodes that are
not its ancestors: in the C++ kernel's rows, else in the explicit mask (every sequence of
the step, decode rows included, takes it then).
A sliding window (per layer) masks keys more than `window - 1` positions before the
query (transformers' `kv_idx > q_idx - window`). A soft-cap (Gemma 2) bounds each
score as cap * tanh(score / cap) before the mask and softmax; SDPA cannot do that, so
those layers compute the scores explicitly, in the order transformers' eager path does.
Attention sinks (gpt-oss) are a learned logit per head appended to every row of scores
before the softmax and dropped after it (weight in the denominator, no value): also
computed explicitly, as transformers' GptOssAttention does.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from backend.attention import cpu_decode
from backend.attention.metadata import AttentionMetadata, KVCacheLayer
from backend.ops.cpu_build import heads_dense
from backend.ops.fp8_quant import FP8_MAX as FP8_E4M3_MAX

# Decode rows attend in groups of this many, sorted by length (decode_groups):
# at 128 rows of 64-512 tokens, 8 groups halved the attention's CPU time against one padded
# batch (SDPA's cost follows the padded length); fewer rows than this stay one batch.
DECODE_BUCKET_ROWS = 16
INT8_MAX = 127.0


def fp32_reciprocal(scale: float) -> float:
    """1/scale as the IEEE fp32 division 1 / fp32(scale): what the Triton kernel computes
    (tl.math.div_rn on the fp32 scale it loads), so both paths multiply by exactly this
    value and store the same FP8 bytes. (Rounding the double 1/scale to fp32 differs by
    an ulp for about a quarter of scales.)"""
    one = torch.tensor(1.0, dtype=torch.float32)
    return (one / torch.tensor(scale, dtype=torch.float32)).item()


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    inv = torch.tensor(fp32_reciprocal(scale), dtype=torch.float32, device=x.device)
    return (x.float() * inv).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, KVH, D] -> int8 round(x / scale[h]) clamped to [-127, 127] (symmetric: -128
    unused), scale [KVH] fp32. Multiplies by the IEEE fp32 reciprocal and rounds half to
    even, as the Triton kernels do, so both paths store the same bytes."""
    inv = torch.ones_like(scale) / scale
    return torch.round((x.float() * inv[:, None]).clamp(-INT8_MAX, INT8_MAX)).to(torch.int8)


def kv_scales(cache: KVCacheLayer) -> tuple:
    """What _gather multiplies K and V by: the layer's floats, or for an INT8 cache its
    per-head scale tensors ([KVH] fp32, on the cache's device, made once)."""
    if cache.is_int8:
        s = cache.scale_tensor()
        return s[0], s[1]
    return cache.k_scale, cache.v_scale


def write_kv(key: torch.Tensor, value: torch.Tensor, cache: KVCacheLayer, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V ([T, KVH, D]) into the paged cache through slot_mapping."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    k_flat = cache.key.view(-1, num_kv_heads, head_dim)
    v_flat = cache.value.view(-1, num_kv_heads, head_dim)
    if cache.is_fp8:
        key, value = quantize_fp8(key, cache.k_scale), quantize_fp8(value, cache.v_scale)
        # index_copy_ has no FP8 kernel on every device; bytes are bytes.
        k_flat, v_flat = k_flat.view(torch.uint8), v_flat.view(torch.uint8)
        key, value = key.view(torch.uint8), value.view(torch.uint8)
    elif cache.is_int8:
        k_scale, v_scale = kv_scales(cache)
        key, value = quantize_int8(key, k_scale), quantize_int8(value, v_scale)
    # No padding rows (slot -1) reach this path: only CUDA graphs pad, and they run the
    # Triton kernel. Checking here would cost a host sync per layer.
    slot_mapping = slot_mapping.long()
    k_flat.index_copy_(0, slot_mapping, key.to(k_flat.dtype))
    v_flat.index_copy_(0, slot_mapping, value.to(v_flat.dtype))


# Gather outputs reused from step to step, per thread (an engine runs on one thread;
# layers run one after another, so one buffer each for K and V serves them all). On the
# CPU a fresh tensor of this size is page-faulted in on first touch, every step: measured
# at batch 256 x 512 keys, 9.5 ms into a reused buffer vs 60 ms into new ones.
_workspace = threading.local()


def _reused_buffer(slot: int, numel: int, like: torch.Tensor) -> torch.Tensor:
    bufs = getattr(_workspace, "bufs", None)
    if bufs is None:
        bufs = _workspace.bufs = {}
    key = (slot, like.dtype, like.device)
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        # A normal tensor even when made inside a step's inference_mode: an inference
        # tensor could not be written later outside it (export, direct model calls).
        with torch.inference_mode(False):
            buf = bufs[key] = torch.empty(numel + numel // 4, dtype=like.dtype, device=like.device)
    return buf[:numel]


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, scale, dtype: torch.dtype,
            slot: Optional[int] = None) -> torch.Tensor:
    """[..., nblk] block ids -> [..., nblk * block_size, KVH, D] in `dtype`. With a
    workspace slot the blocks land in a reused buffer (valid until the next gather into
    that slot). scale: a float (FP8), or [KVH] per-head scales (INT8)."""
    flat = block_ids.reshape(-1)
    if slot is None:
        x = cache.index_select(0, flat)
    else:
        out = _reused_buffer(slot, flat.numel() * cache[0].numel(), cache).view(flat.numel(), *cache.shape[1:])
        x = torch.index_select(cache, 0, flat, out=out)
    x = x.view(*block_ids.shape[:-1], block_ids.shape[-1] * cache.shape[1], *cache.shape[2:])
    if cache.dtype == torch.float8_e4m3fn:
        return (x.float() * scale).to(dtype)
    if cache.dtype == torch.int8:
        return (x.float() * scale[:, None]).to(dtype)
    return x.to(dtype)


@dataclass
class DecodeGroup:
    """Up to DECODE_BUCKET_ROWS decode sequences of similar length, with what every layer
    of the step needs for them: made once per step, not once per layer."""
    seq_ids: list[int]                  # indices into the step's sequences
    rows: torch.Tensor                  # their query rows, on the device
    tables: torch.Tensor                # [B, nblk] int64 block ids, nblk covering the longest
    lens: torch.Tensor                  # [B] their lengths, on the device
    allowed: torch.Tensor               # [B, 1, 1, L] keys each may attend to (no window)


def decode_groups(meta: AttentionMetadata, block_size: int, device: torch.device) -> list[DecodeGroup]:
    """The step's decode sequences (one query token each) by groups of DECODE_BUCKET_ROWS
    of similar length, sorted on the host's copy of the lengths. Each group is gathered
    and padded only to its own longest, where one batch would pad every row to the
    step's longest. Planned by the step's first layer, read by the others."""
    plans = meta.decode_plan
    if plans is None:
        plans = meta.decode_plan = {}
    if block_size not in plans:
        qsl = [0] + list(itertools.accumulate(meta.query_lens_cpu))
        seqs = sorted((i for i, n in enumerate(meta.query_lens_cpu) if n == 1), key=meta.seq_lens_cpu.__getitem__)
        groups = []
        for a in range(0, len(seqs), DECODE_BUCKET_ROWS):
            ids = seqs[a:a + DECODE_BUCKET_ROWS]
            seq_lens = [meta.seq_lens_cpu[i] for i in ids]
            nblk = -(-max(seq_lens) // block_size)
            lens = torch.tensor(seq_lens, device=device)
            allowed = torch.arange(nblk * block_size, device=device)[None, :] < lens[:, None]
            groups.append(DecodeGroup(ids, torch.tensor([qsl[i] for i in ids], dtype=torch.long, device=device),
                                      meta.block_tables[ids, :nblk].long(), lens, allowed[:, None, None, :]))
        plans[block_size] = groups
    return plans[block_size]


def tree_visible(k_pos: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """[n, L]: whether each query may see each key as far as its tree goes (nodes: [n, 2]
    tree start and mask): keys before its tree's nodes, and the nodes its mask sets."""
    rel = k_pos[None, :] - nodes[:, 0:1]
    bit = torch.bitwise_right_shift(nodes[:, 1:2], rel.clamp(0, 63)) & 1
    return (rel < 0) | (bit == 1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
           logits_soft_cap: Optional[float], sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(mask(cap(q k^T * scale))) v over [..., H, n, D] queries and [..., KVH, L, D]
    keys/values (GQA: H a multiple of KVH); allowed broadcasts to [..., H, n, L]. sinks
    ([H]): one more logit per head in each softmax, whose probability is dropped."""
    gqa = q.shape[-3] != k.shape[-3]
    if logits_soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    if gqa:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if logits_soft_cap is not None:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
    sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


class TorchPagedAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: Optional[int] = None, logits_soft_cap: Optional[float] = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCacheLayer,
                meta: AttentionMetadata, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; sinks: [H] or None. Returns [T, H, D]."""
        lib = cpu_decode.kernel() if cpu_decode.supports(q, cache.key, cache.value, self.logits_soft_cap, sinks) else None
        tree = meta.tree is not None
        if meta.key_limits is not None:
            lib = None              # (the C++ kernel is causal: an image-attention step runs here)
        if lib is None or not cpu_decode.write_kv(lib, k, v, cache.key, cache.value, meta.slot_mapping):
            write_kv(k, v, cache, meta.slot_mapping)
        out = torch.empty_like(q)
        covered = None
        if lib is not None and heads_dense(out):
            # On the CPU: one call for every decode row and the prompt tokens of short
            # sequences, K/V read in place (cpu_decode.py); the rest below.
            plan = cpu_decode.decode_plan(meta)
            cpu_decode.paged_decode(lib, q, cache.key, cache.value, plan, self.scale, self.sliding_window, out)
            covered = plan.covers
        elif not tree:
            for group in decode_groups(meta, cache.block_size, q.device):
                out.index_copy_(0, group.rows,
                                self._decode_group(q.index_select(0, group.rows), cache, group, sinks))
        qsl = [0] + list(itertools.accumulate(meta.query_lens_cpu))   # host copy: no sync
        for i, n in enumerate(meta.query_lens_cpu):
            if (n > 1 or (tree and n)) and (covered is None or not covered[i]):
                s = qsl[i]
                limits = meta.key_limits[s:s + n] if meta.key_limits is not None else None
                nodes = meta.tree[s:s + n] if tree else None
                out[s:s + n] = self._prefill(q[s:s + n], cache, meta.block_tables[i], meta.seq_lens_cpu[i], sinks,
                                             limits, nodes)
        return out

    def _decode_group(self, q: torch.Tensor, cache: KVCacheLayer, group: DecodeGroup,
                      sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        # One gather copy; the [B, L, KVH, D] -> [B, KVH, L, D] transpose stays a view,
        # which SDPA reads through its strides.
        k_scale, v_scale = kv_scales(cache)
        k = _gather(cache.key, group.tables, k_scale, q.dtype, slot=0).transpose(1, 2)
        v = _gather(cache.value, group.tables, v_scale, q.dtype, slot=1).transpose(1, 2)
        allowed = group.allowed
        if self.sliding_window is not None:
            pos = torch.arange(k.shape[2], device=q.device)
            allowed = allowed & (pos[None, :] > (group.lens[:, None] - 1 - self.sliding_window))[:, None, None, :]
        B, H, D = q.shape
        if self.logits_soft_cap is None and sinks is None and H != self.num_kv_heads:
            # GQA as queries: the H / KVH query heads of a KV head are that head's rows
            # (heads h of KV head h // (H / KVH)). SDPA then runs KVH heads of that many
            # queries instead of H heads of one: 7-16% faster per call on CPU (one
            # thread, 16 rows, 64-512 keys, the gathers included).
            o = F.scaled_dot_product_attention(q.view(B, self.num_kv_heads, H // self.num_kv_heads, D), k, v,
                                               attn_mask=allowed, scale=self.scale)
            return o.reshape(B, H, D)
        o = attend(q[:, :, None, :], k, v, allowed, self.scale, self.logits_soft_cap, sinks)
        return o[:, :, 0, :]

    def _prefill(self, q: torch.Tensor, cache: KVCacheLayer, block_table: torch.Tensor,
                 seq_len: int, sinks: Optional[torch.Tensor] = None,
                 limits: Optional[torch.Tensor] = None,
                 nodes: Optional[torch.Tensor] = None) -> torch.Tensor:
        """limits: each query's key count (AttentionMetadata.key_limits) or None: causal.
        nodes: each query's [tree start, tree mask] (AttentionMetadata.tree), or None."""
        n = q.shape[0]
        nblk = -(-seq_len // cache.block_size)
        blocks = block_table[:nblk].long()
        k_scale, v_scale = kv_scales(cache)
        k = _gather(cache.key, blocks, k_scale, q.dtype)[:seq_len]
        v = _gather(cache.value, blocks, v_scale, q.dtype)[:seq_len]
        # [1, heads, tokens, D]: SDPA's fused CPU kernel (flash attention) takes 4-D
        # inputs only; 3-D ones ran its math path, 1.7-3x slower (benchmarks §16).
        q, k, v = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        if seq_len == n and self.sliding_window is None and self.logits_soft_cap is None and sinks is None \
                and limits is None and nodes is None:
            # The whole sequence in this chunk: SDPA's own causal mask, whose kernel skips
            # the masked key blocks (half the work of an explicit mask at long prompts).
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                               enable_gqa=self.num_heads != self.num_kv_heads)
            return o[0].transpose(0, 1)
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        allowed = k_pos[None, :] <= q_pos[:, None] if limits is None else k_pos[None, :] < limits[:, None].long()
        if self.sliding_window is not None:
            allowed &= k_pos[None, :] > (q_pos[:, None] - self.sliding_window)
        if nodes is not None:
            allowed &= tree_visible(k_pos, nodes)
        o = attend(q, k, v, allowed, self.scale, self.logits_soft_cap, sinks)
        return o[0].transpose(0, 1)
