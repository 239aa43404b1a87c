"""Device functions shared by the attention kernels (triton_attention.py, the one-token
kernel the TensorRT plugin also launches; triton_tiled.py, the tensor-core kernel for
steps with prompts): E4M3 and INT8 rounding, loading K/V from the pool or this step's
input, writing K/V, the token -> sequence search and the cache scales (one per layer for
FP8, one per KV head for INT8)."""

import torch
import triton
import triton.language as tl


def _as_storage(cache: torch.Tensor) -> torch.Tensor:
    """The KV pool as the kernels address it: FP8 pools as bytes (the kernels decode them)."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


@triton.jit
def _round_to_e4m3(x):
    """Round fp32 to the nearest E4M3 value (ties to even), in fp32 arithmetic that is
    exact. Triton 3.x's interpreter loses the carry when a cast to float8e4nv rounds up
    across a power of two (-31.2 became -16); a value already on the grid casts exactly
    everywhere."""
    x = tl.clamp(x, -448.0, 448.0)
    bits = x.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, -6)                   # below 2^-6: subnormal spacing 2^-9
    step = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)   # 2^(exp-3): 3 mantissa bits
    return _round_half_even(x / step) * step    # exact: step is a power of two


@triton.jit
def _round_half_even(y):
    """y rounded to the nearest integer, ties to even (torch.round), exact in fp32 for
    |y| < 2^22."""
    f = tl.floor(y)
    frac = y - f
    half_even = f + (f - 2.0 * tl.floor(f * 0.5))  # f rounded up iff f is odd
    return tl.where(frac > 0.5, f + 1.0, tl.where(frac < 0.5, f, half_even))


@triton.jit
def _quantize_int8(x, inv):
    """round(x / scale) clamped to [-127, 127], as fp32 (torch_attention.quantize_int8)."""
    return _round_half_even(tl.clamp(x.to(tl.float32) * inv, -127.0, 127.0))


@triton.jit
def _load_kv(cache_ptr, x_ptr, rows, src, stride_t, stride_h, kvh, d, cached, fresh, dmask, scale, inv,
             NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, FP8: tl.constexpr, INT8: tl.constexpr = False):
    """[BLOCK_SIZE, BLOCK_D] keys (or values) in fp32: `cached` rows from the pool,
    `fresh` rows from this step's input, both as the pool holds them."""
    cmask = cached[:, None] & dmask[None, :]
    fmask = fresh[:, None] & dmask[None, :]
    x = tl.load(x_ptr + src[:, None] * stride_t + kvh * stride_h + d[None, :], mask=fmask, other=0.0)
    cptrs = cache_ptr + rows[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM + d[None, :]
    if FP8:
        c = tl.load(cptrs, mask=cmask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
        x = _round_to_e4m3(x.to(tl.float32) * inv) * scale
    elif INT8:
        c = tl.load(cptrs, mask=cmask, other=0).to(tl.float32) * scale
        x = _quantize_int8(x, inv) * scale
    else:
        c = tl.load(cptrs, mask=cmask, other=0.0).to(tl.float32)
        x = x.to(cache_ptr.dtype.element_ty).to(tl.float32)
    return tl.where(cmask, c, x)


@triton.jit
def _soft_cap(qk, SOFTCAP: tl.constexpr):
    """cap * tanh(qk / cap) (Gemma 2's attention soft-cap), tanh from one exp of a
    non-positive argument, so it neither overflows nor loses the sign."""
    if SOFTCAP > 0:
        x = qk / SOFTCAP
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        qk = tl.where(x < 0, -t, t) * SOFTCAP
    return qk


@triton.jit
def _softmax_start(sinks_ptr, heads, valid, N: tl.constexpr, HAS_SINKS: tl.constexpr):
    """(running max, running sum) [N] that an online softmax starts from: (-inf, 0), or
    with attention sinks (gpt-oss) the head's sink logit counted once, exp(sink - sink) = 1,
    so it weighs in every denominator and adds nothing to the output."""
    if HAS_SINKS:
        m = tl.load(sinks_ptr + heads, mask=valid, other=float("-inf")).to(tl.float32)
        l = tl.where(valid, 1.0, 0.0)
    else:
        m = tl.full([N], float("-inf"), tl.float32)
        l = tl.zeros([N], tl.float32)
    return m, l


@triton.jit
def _find_seq(query_start_loc_ptr, t, num_seqs, TILE: tl.constexpr = 0):
    """The sequence that owns packed token t: the last s with query_start_loc[s] <= t
    (binary search, so the kernel needs no token->sequence input). With TILE > 0, the
    sequence that owns tile program t: the last s with query_start_loc[s] // TILE + s
    <= t (triton_tiled.py)."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        key = tl.load(query_start_loc_ptr + mid)
        if TILE > 0:
            key = key // TILE + mid
        if key <= t:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _kv_scales(k_scale_ptr, v_scale_ptr, kvh=0, PER_HEAD: tl.constexpr = False):
    """(k_scale, v_scale, 1/k_scale, 1/v_scale) in fp32, of KV head kvh when the scales
    are per head (INT8); the reciprocals are the IEEE division the torch path computes
    too."""
    head = kvh if PER_HEAD else 0
    k_scale = tl.load(k_scale_ptr + head).to(tl.float32)
    v_scale = tl.load(v_scale_ptr + head).to(tl.float32)
    return k_scale, v_scale, tl.math.div_rn(1.0, k_scale), tl.math.div_rn(1.0, v_scale)


@triton.jit
def _store_kv(k_cache_out_ptr, v_cache_out_ptr, dst, k_rows, v_rows, mask, k_inv, v_inv, FP8: tl.constexpr,
              INT8: tl.constexpr = False):
    """Write K/V rows (any shape) at element offsets dst of the pools, as the pool stores
    them: E4M3 bytes of x / scale, int8 round(x / scale), or the pool's dtype."""
    if FP8:
        k_q = _round_to_e4m3(k_rows.to(tl.float32) * k_inv)
        v_q = _round_to_e4m3(v_rows.to(tl.float32) * v_inv)
        tl.store(k_cache_out_ptr + dst, k_q.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=mask)
        tl.store(v_cache_out_ptr + dst, v_q.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=mask)
    elif INT8:
        tl.store(k_cache_out_ptr + dst, _quantize_int8(k_rows, k_inv).to(tl.int8), mask=mask)
        tl.store(v_cache_out_ptr + dst, _quantize_int8(v_rows, v_inv).to(tl.int8), mask=mask)
    else:
        tl.store(k_cache_out_ptr + dst, k_rows.to(k_cache_out_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_out_ptr + dst, v_rows.to(v_cache_out_ptr.dtype.element_ty), mask=mask)
