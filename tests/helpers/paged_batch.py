"""A random paged batch for attention tests: scattered blocks, a cached context written
by the torch writer, and this step's q/k/v."""

import random

import torch

from backend.attention.metadata import AttentionMetadata, KVCacheLayer
from backend.attention.torch_attention import write_kv as torch_write_kv


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def build(seqs, block_size, num_kv_heads, group, head_dim, seed, fp8=False, num_blocks=None, fp8_scales=(0.05, 0.04),
          int8_scales=None):
    """seqs: [(cached_context_len, new_query_len)]. Returns (q, k, v, cache, meta).
    int8_scales: (K scales, V scales), one per KV head, for an INT8 cache."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    H = num_kv_heads * group
    need = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = num_blocks or sum(need) + 3
    perm = list(range(num_blocks))
    rng.shuffle(perm)  # scattered physical blocks
    tables, it = [], iter(perm)
    for n in need:
        tables.append([next(it) for _ in range(n)])
    dtype = torch.float8_e4m3fn if fp8 else torch.int8 if int8_scales else torch.float32
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    scales = fp8_scales if fp8 else int8_scales or (1.0, 1.0)
    cache = KVCacheLayer(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype), *scales)
    # Fill the cached context with the reference writer.
    ctx_slots = [t[p // block_size] * block_size + p % block_size for (c, _), t in zip(seqs, tables) for p in range(c)]
    if ctx_slots:
        kk = torch.randn(len(ctx_slots), num_kv_heads, head_dim, generator=g)
        vv = torch.randn(len(ctx_slots), num_kv_heads, head_dim, generator=g)
        torch_write_kv(kk, vv, cache, torch.tensor(ctx_slots))
    T = sum(n for _, n in seqs)
    q = torch.randn(T, H, head_dim, generator=g)
    k = torch.randn(T, num_kv_heads, head_dim, generator=g)
    v = torch.randn(T, num_kv_heads, head_dim, generator=g)
    slots, qsl = [], [0]
    for (c, n), t in zip(seqs, tables):
        slots += [t[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
        qsl.append(qsl[-1] + n)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_lens_cpu=[n for _, n in seqs],
        seq_lens_cpu=[c + n for c, n in seqs], max_query_len=max(n for _, n in seqs),
        max_seq_len=max(c + n for c, n in seqs))
    return q, k, v, cache, meta


def to(dev, q, k, v, cache, meta):
    m = AttentionMetadata(meta.query_start_loc.to(dev), meta.seq_lens.to(dev), meta.block_tables.to(dev),
                          meta.slot_mapping.to(dev), meta.query_lens_cpu, meta.seq_lens_cpu,
                          meta.max_query_len, meta.max_seq_len,
                          key_limits=meta.key_limits.to(dev) if meta.key_limits is not None else None,
                          tree=meta.tree.to(dev) if meta.tree is not None else None)
    c = KVCacheLayer(cache.key.clone().to(dev), cache.value.clone().to(dev), cache.k_scale, cache.v_scale)
    return q.to(dev), k.to(dev), v.to(dev), c, m
