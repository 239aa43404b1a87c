"""Paged attention for steps with prompts in them, on tensor cores: one program per tile
of BLOCK_M query tokens of one sequence and one KV head, QK^T and PV as `tl.dot` over
[BLOCK_M x GROUP, D] x [D, BLOCK_N] tiles (bf16/fp16 inputs on tensor cores; IEEE fp32
for fp32 models, so results agree with the torch reference to ~1e-6).

Like the one-token kernel (triton_attention.py), one launch writes the tiles' K/V into
the pool and attends, reads this step's keys from the k/v inputs and cached keys from
the pool (FP8 or INT8 dequantized in registers), and takes the PagedAttention node's inputs.

Which sequence a program serves needs no extra input (vLLM's unified-attention trick):
with c[s] = query_start_loc[s] // BLOCK_M + s, sequence s owns programs c[s] up to
c[s] + ceil(q_len[s] / BLOCK_M) - 1 < c[s + 1], so program p belongs to the last s with
c[s] <= p, and T // BLOCK_M + B programs always suffice (a host-side count, no sync).
Programs that land past their sequence's last tile do nothing. Attention sinks: as in
the one-token kernel, each row's online softmax starts at (sink, 1).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from backend.attention.triton_common import (_as_storage, _find_seq, _kv_scales, _load_kv, _soft_cap,
                                             _softmax_start, _store_kv)


@triton.jit
def _tiled_attention_kernel(
        q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, block_tables_ptr, seq_lens_ptr,
        query_start_loc_ptr, k_scale_ptr, v_scale_ptr,
        num_seqs, stride_bt, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_ot, stride_oh,
        out_ptr, k_cache_out_ptr, v_cache_out_ptr, sinks_ptr,
        NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        SM_SCALE: tl.constexpr, SLIDING_WINDOW: tl.constexpr, FP8: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr = 0.0,
        INT8: tl.constexpr = False, HAS_SINKS: tl.constexpr = False):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    k_scale, v_scale, k_inv, v_inv = _kv_scales(k_scale_ptr, v_scale_ptr, kvh, INT8)

    s = _find_seq(query_start_loc_ptr, pid, num_seqs, BLOCK_M)
    q_start = tl.load(query_start_loc_ptr + s)
    q_len = tl.load(query_start_loc_ptr + s + 1) - q_start
    tile = pid - (q_start // BLOCK_M + s)
    t0 = q_start + tile * BLOCK_M                   # first packed token of this tile
    n_valid = tl.minimum(tl.maximum(q_len - tile * BLOCK_M, 0), BLOCK_M)
    ctx_len = tl.load(seq_lens_ptr + s) - q_len     # tokens cached before this step

    # This tile's K/V for this head go to their slots (slot -1: padding, nothing).
    m = tl.arange(0, BLOCK_M)
    mvalid = m < n_valid
    slots = tl.load(slot_ptr + t0 + m, mask=mvalid, other=-1).to(tl.int64)
    wmask = (slots >= 0)[:, None] & dmask[None, :]
    k_rows = tl.load(k_ptr + (t0 + m)[:, None] * stride_kt + kvh * stride_kh + d[None, :], mask=wmask, other=0.0)
    v_rows = tl.load(v_ptr + (t0 + m)[:, None] * stride_vt + kvh * stride_vh + d[None, :], mask=wmask, other=0.0)
    dst = slots[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM + d[None, :]
    _store_kv(k_cache_out_ptr, v_cache_out_ptr, dst, k_rows, v_rows, wmask, k_inv, v_inv, FP8, INT8)

    # Rows of the Q tile: (token m, query head g of this KV head), flattened.
    r = tl.arange(0, BLOCK_M * BLOCK_G)
    rm = r // BLOCK_G
    rg = r % BLOCK_G
    rvalid = (rm < n_valid) & (rg < GROUP)
    tok = t0 + rm
    heads = kvh * GROUP + rg
    pos = ctx_len + (tok - q_start)                 # each row's position in its sequence
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=rvalid[:, None] & dmask[None, :], other=0.0)

    first_pos = ctx_len + tile * BLOCK_M
    kv_hi = tl.where(n_valid > 0, first_pos + n_valid, 0)     # causal limit of the tile's last row
    kv_lo = 0
    if SLIDING_WINDOW > 0:
        kv_lo = tl.maximum(first_pos - SLIDING_WINDOW + 1, 0)
    kv_lo = (kv_lo // BLOCK_N) * BLOCK_N

    m_i, l_i = _softmax_start(sinks_ptr, heads, rg < GROUP, BLOCK_M * BLOCK_G, HAS_SINKS)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for kstart in range(kv_lo, kv_hi, BLOCK_N):
        key_pos = kstart + n
        in_range = key_pos < kv_hi
        phys = tl.load(block_tables_ptr + s * stride_bt + key_pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        rows = phys * BLOCK_SIZE + key_pos % BLOCK_SIZE
        cached = in_range & (key_pos < ctx_len)
        fresh = in_range & (key_pos >= ctx_len)
        src = q_start + key_pos - ctx_len
        k = _load_kv(k_cache_ptr, k_ptr, rows, src, stride_kt, stride_kh, kvh, d, cached, fresh, dmask,
                     k_scale, k_inv, NUM_KV_HEADS, HEAD_DIM, FP8, INT8)
        v = _load_kv(v_cache_ptr, v_ptr, rows, src, stride_vt, stride_vh, kvh, d, cached, fresh, dmask,
                     v_scale, v_inv, NUM_KV_HEADS, HEAD_DIM, FP8, INT8)
        if IEEE:
            qk = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k.to(q.dtype)))
        qk = _soft_cap(qk * SM_SCALE, SOFTCAP)
        allowed = rvalid[:, None] & in_range[None, :] & (key_pos[None, :] <= pos[:, None])
        if SLIDING_WINDOW > 0:
            allowed = allowed & (key_pos[None, :] > pos[:, None] - SLIDING_WINDOW)
        qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(qk - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rvalid[:, None] & dmask[None, :])


# Query tokens per tile: with the GQA group, 16 to 128 rows of a tensor-core tile.
BLOCK_M = 16
BLOCK_N = 64
# Keys per tile shrink until the Q, K, V and P tiles' estimate fits this. The compiled
# kernel's shared memory came to about 1.6x the estimate on an H100 (fp32, 128 rows,
# D 128, 64 keys: 257 KiB against a 227 KiB limit), so this leaves it near 180 KiB.
TILE_BYTES = 112 * 1024


def _tile_bytes(rows: int, block_d: int, block_n: int, element_size: int) -> int:
    return element_size * (rows * block_d + 2 * block_n * block_d + rows * block_n)


def key_tile(rows: int, block_d: int, element_size: int) -> int:
    """BLOCK_N for a [rows, block_d] query tile: 64 keys, fewer (down to 16) for fp32 or
    wide tiles that would not fit an SM's shared memory."""
    block_n = BLOCK_N
    while block_n > 16 and _tile_bytes(rows, block_d, block_n, element_size) > TILE_BYTES:
        block_n //= 2
    return block_n


def fit_tiles(block_m: int, block_g: int, block_d: int, element_size: int) -> tuple[int, int]:
    """(block_m, BLOCK_N): the query tile keeps at least the 16 rows tl.dot needs, and
    loses tokens where even 16 keys would not fit (fp32 with a GQA group of 16 and D 128:
    256 rows)."""
    while block_m > 1 and block_m * block_g > 16 and _tile_bytes(block_m * block_g, block_d, 16,
                                                                 element_size) > TILE_BYTES:
        block_m //= 2
    return block_m, key_tile(block_m * block_g, block_d, element_size)


def launch_tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                           v_pool: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, query_start_loc: torch.Tensor, k_scale: torch.Tensor,
                           v_scale: torch.Tensor, out: torch.Tensor, scale: float,
                           sliding_window: Optional[int] = None, block_m: int = BLOCK_M,
                           logits_soft_cap: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> None:
    """Same tensors and contract as launch_paged_attention; rows of padding tokens (past
    the last sequence) are left as they are. block_m: query tokens per tile (a power of
    two, at least 16 rows with the GQA group). A tile never spans sequences: a decode row's
    tile holds its one token (16 // group tokens is the least that gives tl.dot its 16
    rows). Where even 16 keys would not fit shared memory, block_m shrinks (fit_tiles)."""
    T, H, D = q.shape
    num_seqs = seq_lens.shape[0]
    if T == 0:
        return
    num_kv_heads, block_size = k_pool.shape[2], k_pool.shape[1]
    group = H // num_kv_heads
    block_g = max(triton.next_power_of_2(group), 1)
    if block_m * block_g < 16:
        raise ValueError(f"tiles of {block_m} tokens x {block_g} heads have fewer than the 16 rows tl.dot needs")
    fp8 = k_pool.dtype in (torch.float8_e4m3fn, torch.uint8)
    block_d = max(triton.next_power_of_2(D), 16)
    block_m, block_n = fit_tiles(block_m, block_g, block_d, 4 if q.dtype == torch.float32 else 2)
    k_pool, v_pool = _as_storage(k_pool), _as_storage(v_pool)
    _tiled_attention_kernel[(T // block_m + num_seqs, num_kv_heads)](
        q, k, v, k_pool, v_pool, slot_mapping, block_tables, seq_lens, query_start_loc, k_scale, v_scale,
        num_seqs, block_tables.stride(0), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        out, k_pool, v_pool, sinks,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, BLOCK_G=block_g,
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_SIZE=block_size, SM_SCALE=float(scale),
        SLIDING_WINDOW=int(sliding_window or 0), FP8=bool(fp8), BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, SOFTCAP=float(logits_soft_cap or 0.0), INT8=k_pool.dtype == torch.int8,
        HAS_SINKS=sinks is not None)
