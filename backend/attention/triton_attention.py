"""Paged attention with the KV write, in OpenAI Triton: one kernel launch per layer.

One launch serves the whole step, whatever it mixes: decode, prefill, chunked prefill
and prefix-cache hits. A program handles one query token and one KV head: it writes
that token's K/V into its slot, finds its sequence by binary search over
query_start_loc, loads the query heads that share the KV head (GQA packing), walks the
sequence's block table up to the token's causal limit and keeps an online softmax.
Keys cached by earlier steps are read from the pool, this step's keys from the k/v
inputs (so no program waits for another's write). The inputs are exactly those of the
exported `PagedAttention` node, which is why the same kernel is the TensorRT plugin's
(see backend/attention/trt_plugin.py). With `num_splits > 1`
the KV range is split across a third grid axis (split-KV, for long contexts at small
batch) and a second kernel merges the partial results.

Attention sinks (gpt-oss, `sinks_ptr` with HAS_SINKS) start each head's online softmax
at (m, l) = (sink, 1): the sink's weight is in the denominator and nothing in the sum.

FP8 (E4M3) caches are stored as raw bytes (uint8 views) and dequantized with the
layer's scale inside the kernel; INT8 caches (int8 tensors) with the KV head's scale
(k_scale / v_scale then point at [num_kv_heads] fp32). With TRITON_INTERPRET=1
everything runs on CPU tensors, which is how CI checks it. Dot products are fp32 sums (no TF32), so the kernel agrees
with the torch reference to ~1e-6 in fp32.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from backend.attention.metadata import AttentionMetadata, KVCacheLayer
from backend.attention.triton_common import (_as_storage, _find_seq, _kv_scales, _load_kv, _soft_cap,
                                             _softmax_start, _store_kv)


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, block_tables_ptr, seq_lens_ptr,
        query_start_loc_ptr, k_scale_ptr, v_scale_ptr,
        num_seqs, stride_bt, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_ot, stride_oh,
        out_ptr, k_cache_out_ptr, v_cache_out_ptr, part_acc_ptr, part_ml_ptr, sinks_ptr, limits_ptr, tree_ptr,
        NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        SM_SCALE: tl.constexpr, SLIDING_WINDOW: tl.constexpr, FP8: tl.constexpr, NUM_SPLITS: tl.constexpr,
        SOFTCAP: tl.constexpr = 0.0, INT8: tl.constexpr = False, HAS_SINKS: tl.constexpr = False,
        HAS_LIMITS: tl.constexpr = False, HAS_TREE: tl.constexpr = False):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    k_scale, v_scale, k_inv, v_inv = _kv_scales(k_scale_ptr, v_scale_ptr, kvh, INT8)

    # This token's K/V for this head go to its slot (once, by split 0; slot -1 = padding).
    slot = tl.load(slot_ptr + t)
    wmask = d < tl.where((slot >= 0) & (split == 0), HEAD_DIM, 0)
    k_row = tl.load(k_ptr + t * stride_kt + kvh * stride_kh + d, mask=wmask, other=0.0)
    v_row = tl.load(v_ptr + t * stride_vt + kvh * stride_vh + d, mask=wmask, other=0.0)
    dst = slot.to(tl.int64) * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM + d
    _store_kv(k_cache_out_ptr, v_cache_out_ptr, dst, k_row, v_row, wmask, k_inv, v_inv, FP8, INT8)

    s = _find_seq(query_start_loc_ptr, t, num_seqs)
    q_start = tl.load(query_start_loc_ptr + s)
    q_len = tl.load(query_start_loc_ptr + s + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + s)
    ctx_len = seq_len - q_len                       # tokens cached before this step
    pos = ctx_len + (t - q_start)                   # this token's position in its sequence
    # Rows past the last sequence (padding) attend to nothing.
    causal_end = pos + 1
    if HAS_LIMITS:                                  # an image's tokens see the whole image (Gemma 3)
        causal_end = tl.load(limits_ptr + t)
    kv_end = tl.where(t < q_start + q_len, causal_end, 0)
    if HAS_TREE:                                    # a tree of proposals: [T, 2] int64 (start, bits)
        tree_start = tl.load(tree_ptr + 2 * t)
        tree_bits = tl.load(tree_ptr + 2 * t + 1)
    kv_start = 0
    if SLIDING_WINDOW > 0:
        kv_start = tl.maximum(pos - SLIDING_WINDOW + 1, 0)

    g = tl.arange(0, BLOCK_G)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)

    first_block = kv_start // BLOCK_SIZE
    num_blocks = tl.maximum(tl.cdiv(kv_end, BLOCK_SIZE) - first_block, 0)
    per_split = tl.cdiv(num_blocks, NUM_SPLITS)
    b_lo = first_block + split * per_split
    b_hi = tl.minimum(b_lo + per_split, first_block + num_blocks)

    # The sink (if any) joins split 0's partial only, so the merge counts it once.
    m_i, l_i = _softmax_start(sinks_ptr, heads, gmask & (g * 0 + split == 0), BLOCK_G, HAS_SINKS)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    offs = tl.arange(0, BLOCK_SIZE)
    for b in range(b_lo, b_hi):
        phys = tl.load(block_tables_ptr + s * stride_bt + b).to(tl.int64)
        key_pos = b * BLOCK_SIZE + offs
        kmask = (key_pos < kv_end) & (key_pos >= kv_start)
        if HAS_TREE:                                # of the tree's nodes, only its ancestors and itself
            rel = key_pos.to(tl.int64) - tree_start
            kmask = kmask & ((rel < 0) | (((tree_bits >> tl.minimum(tl.maximum(rel, 0), 63)) & 1) == 1))
        # Keys cached before this step come from the pool; this step's keys come from
        # the k/v inputs (other programs are writing them to the pool concurrently),
        # rounded exactly as the pool stores them.
        cached = kmask & (key_pos < ctx_len)
        fresh = kmask & (key_pos >= ctx_len)
        rows = phys * BLOCK_SIZE + offs
        src = q_start + key_pos - ctx_len
        k = _load_kv(k_cache_ptr, k_ptr, rows, src, stride_kt, stride_kh, kvh, d, cached, fresh, dmask,
                     k_scale, k_inv, NUM_KV_HEADS, HEAD_DIM, FP8, INT8)
        v = _load_kv(v_cache_ptr, v_ptr, rows, src, stride_vt, stride_vh, kvh, d, cached, fresh, dmask,
                     v_scale, v_inv, NUM_KV_HEADS, HEAD_DIM, FP8, INT8)
        qk = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * SM_SCALE      # [G, BLOCK_SIZE]
        qk = _soft_cap(qk, SOFTCAP)
        qk = tl.where(kmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(qk - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    omask = gmask[:, None] & dmask[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        # Partials laid out [T, H, NUM_SPLITS, ...]: unnormalized acc, then (m, l).
        row = (t * (NUM_KV_HEADS * GROUP) + heads) * NUM_SPLITS + split
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=omask)
        tl.store(part_ml_ptr + row * 2, m_i, mask=gmask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=gmask)


@triton.jit
def _merge_splits_kernel(part_acc_ptr, part_ml_ptr, out_ptr, stride_ot, stride_oh,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = sp < NUM_SPLITS
    row = (t * NUM_HEADS + h) * NUM_SPLITS + sp
    m = tl.load(part_ml_ptr + row * 2, mask=smask, other=float("-inf"))
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :],
                  mask=smask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    l_sum = tl.sum(l * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(l_sum > 0, l_sum, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def choose_num_splits(num_tokens: int, num_kv_heads: int, max_seq_len: int, block_size: int) -> int:
    """Split the KV range when there are too few (token, head) programs to fill the
    device and each has a long context to walk."""
    programs = num_tokens * num_kv_heads
    if programs >= 128 or max_seq_len < 1024:
        return 1
    return int(min(16, triton.next_power_of_2(max(1, max_seq_len // 512))))


def attention_constexprs(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, scale: float,
                         sliding_window: Optional[int], fp8: bool, num_splits: int = 1,
                         logits_soft_cap: Optional[float] = None, int8: bool = False, sinks: bool = False,
                         limits: bool = False, tree: bool = False) -> dict:
    """The kernel's compile-time parameters (shared by the launch here and the AOT build)."""
    group = num_heads // num_kv_heads
    return dict(NUM_KV_HEADS=num_kv_heads, GROUP=group, BLOCK_G=max(triton.next_power_of_2(group), 1),
                HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
                SM_SCALE=float(scale), SLIDING_WINDOW=int(sliding_window or 0), FP8=bool(fp8),
                NUM_SPLITS=num_splits, SOFTCAP=float(logits_soft_cap or 0.0), INT8=bool(int8),
                HAS_SINKS=bool(sinks), HAS_LIMITS=bool(limits), HAS_TREE=bool(tree))


def decode_tile_tokens(num_heads: int, num_kv_heads: int) -> Optional[int]:
    """Query tokens per tile when decode rows take the tiled kernel: the least that gives
    tl.dot its 16 rows with the GQA group (4 at group 4). A tile never spans sequences, so
    a decode row's tile holds one token: group rows of 16 are real. None below group 4,
    where fewer would be (not measured: those stay on the one-token kernel)."""
    block_g = triton.next_power_of_2(max(num_heads // num_kv_heads, 1))
    return None if block_g < 4 else max(1, 16 // block_g)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCacheLayer,
                    meta: AttentionMetadata, scale: float, sliding_window: Optional[int] = None,
                    num_splits: Optional[int] = None, tiled: Optional[bool] = None,
                    logits_soft_cap: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One launch for the whole step: writes k/v ([T, KVH, D]) into the paged cache and
    returns attention of q ([T, H, D]) over each sequence's cache, [T, H, D]. Steps with
    prompt tokens (max_query_len > 1) take the tensor-core tiled kernel (triton_tiled.py).
    Decode steps (and a CUDA graph's, verify rows included) take it too when the KV range
    is not split and the GQA group fills a tile (H100, Llama-3.2-1B shapes: 0.09 against
    0.40 ms at batch 64, 0.25 against 1.25 ms at batch 256, 1k context; docs/archive/benchmarks.md
    §6); otherwise this file's one-token kernel with split-KV (batch 1 at 4k context:
    0.088 against 0.113 ms). sinks: [H] attention-sink logits (gpt-oss) or None."""
    T, H, D = q.shape
    scales = cache.scale_tensor()
    block_m = None
    if meta.key_limits is not None or meta.tree is not None:
        tiled = False               # (key limits, trees: the one-token kernel only)
    if tiled is None and meta.max_query_len > 1 and num_splits is None and meta.num_splits is None:
        tiled = True
    if not tiled:
        # The one-token kernel's split factor: the caller's, a CUDA graph's, or by shape.
        num_splits = num_splits or meta.num_splits or choose_num_splits(T, cache.key.shape[2], meta.max_seq_len,
                                                                        cache.block_size)
        if tiled is None:           # decode rows: the tiled kernel where the KV range is not split
            block_m = decode_tile_tokens(H, cache.key.shape[2]) if num_splits == 1 else None
            tiled = block_m is not None
    if tiled:
        from backend.attention.triton_tiled import BLOCK_M, launch_tiled_attention
        # Rows past the last sequence (padding) belong to no tile: zero them. A CUDA
        # graph's (fixed split factor) may hold padding at replay whatever its shape says.
        padded = meta.num_splits is not None or sum(meta.query_lens_cpu) < T
        out = (torch.zeros if padded else torch.empty)((T, H, D), dtype=q.dtype, device=q.device)
        launch_tiled_attention(q, k, v, cache.key, cache.value, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                               meta.query_start_loc, scales[0:1], scales[1:2], out, scale, sliding_window,
                               block_m=block_m or BLOCK_M, logits_soft_cap=logits_soft_cap, sinks=sinks)
        return out
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    launch_paged_attention(q, k, v, cache.key, cache.value, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                           meta.query_start_loc, scales[0:1], scales[1:2], out, scale, sliding_window, num_splits,
                           logits_soft_cap, sinks, meta.key_limits, meta.tree)
    return out


def launch_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                           v_pool: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, query_start_loc: torch.Tensor, k_scale: torch.Tensor,
                           v_scale: torch.Tensor, out: torch.Tensor, scale: float,
                           sliding_window: Optional[int] = None, num_splits: int = 1,
                           logits_soft_cap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                           key_limits: Optional[torch.Tensor] = None, tree: Optional[torch.Tensor] = None) -> None:
    """The kernel over the PagedAttention node's tensors, in the node's order (what the
    TensorRT plugin's JIT form calls; its AOT form launches the same kernel itself)."""
    T, H, D = q.shape
    if T == 0:
        return
    num_kv_heads, block_size = k_pool.shape[2], k_pool.shape[1]
    fp8 = k_pool.dtype in (torch.float8_e4m3fn, torch.uint8)
    if num_splits > 1:
        part_acc = torch.empty((T, H, num_splits, D), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((T, H, num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    k_pool, v_pool = _as_storage(k_pool), _as_storage(v_pool)
    _paged_attention_kernel[(T, num_kv_heads, num_splits)](
        q, k, v, k_pool, v_pool, slot_mapping, block_tables, seq_lens, query_start_loc, k_scale, v_scale,
        seq_lens.shape[0], block_tables.stride(0), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        out, k_pool, v_pool, part_acc, part_ml, sinks, key_limits, tree,
        **attention_constexprs(H, num_kv_heads, D, block_size, scale, sliding_window, fp8, num_splits,
                               logits_soft_cap, int8=k_pool.dtype == torch.int8, sinks=sinks is not None,
                               limits=key_limits is not None, tree=tree is not None))
    if num_splits > 1:
        _merge_splits_kernel[(T, H)](part_acc, part_ml, out, out.stride(0), out.stride(1),
                                     NUM_HEADS=H, HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D),
                                     NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits))


class TritonPagedAttention:
    """The engine-facing backend; same interface as TorchPagedAttention."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: Optional[int] = None, logits_soft_cap: Optional[float] = None) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCacheLayer,
                meta: AttentionMetadata, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        return paged_attention(q, k, v, cache, meta, self.scale, self.sliding_window,
                               logits_soft_cap=self.logits_soft_cap, sinks=sinks)
