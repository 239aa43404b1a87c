"""MXFP4 weight tiles decoded in registers, for the fused MoE grouped GEMM
(fused_moe_triton.py): gpt-oss's experts kept 4-bit on the device.

The format is backend/ops/mxfp4.py's (OCP MX v1.0): per output row, bytes of two
E2M1 codes (element 2j in the low nibble of byte j) and one E8M0 scale byte per 32
inputs. A [BLOCK_K, BLOCK_N] tile of W^T is read as its bytes (each byte twice: the
two k of a pair) and its scales (one per 32 k), decoded from the bit fields and scaled
by 2^(s - 127); every value is exact in bf16 and fp32, so the tile feeds tl.dot like a
loaded one (Hopper has no FP4 MMA: bf16 tiles on tensor cores). Memory read per weight:
4.25 bits instead of 16.

With bf16 activations the GEMM takes `dot_tile` instead: Triton's own microscaling dot
(`tl.dot_scaled`, the OCP format, the even element in the low nibble as here) reads
each byte once and upcasts in registers with the compiler's bit tricks (native FP4 MMA
where the GPU has it), where `load_weight_tile` reads each byte twice and decodes every
code with two exp2s and four selects. `tl.dot_scaled` takes no fp32 operand, so fp32
(the exact CPU path) keeps the decode here.
"""

import triton
import triton.language as tl


@triton.jit
def _e2m1_times_scale(code, scale_byte):
    """E2M1 codes (int32, 0..15) times 2^(scale_byte - 127), in fp32."""
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * tl.exp2((e - 1).to(tl.float32)))
    val = tl.where((code & 8) != 0, -mag, mag)
    return val * tl.exp2((scale_byte - 127).to(tl.float32))


@triton.jit
def load_weight_tile(w_base, s_base, rows, ks, mask, stride_wn, stride_sn, dtype, MXFP4: tl.constexpr,
                     FP8: tl.constexpr = False):
    """W[rows, ks] as a [BLOCK_K, BLOCK_N] tile (ks down, rows across) in `dtype`: loaded,
    or with MXFP4 decoded from the packed bytes (stride_wn per row) and scales
    (stride_sn per row), or with FP8 E4M3 times its row's fp32 scale (stride_sn per row),
    rounded to `dtype` as the torch reference's dequantization is."""
    if FP8:
        q = tl.load(w_base + rows[None, :] * stride_wn + ks[:, None], mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(s_base + rows[None, :] * stride_sn + ks[:, None] * 0, mask=mask, other=0.0)
        w = (q * scale).to(dtype)
    elif MXFP4:
        byte = tl.load(w_base + rows[None, :] * stride_wn + ks[:, None] // 2, mask=mask, other=0).to(tl.int32)
        code = (byte >> ((ks[:, None] % 2) * 4)) & 0xF
        scale = tl.load(s_base + rows[None, :] * stride_sn + ks[:, None] // 32, mask=mask, other=127).to(tl.int32)
        w = _e2m1_times_scale(code, scale).to(dtype)
    else:
        w = tl.load(w_base + rows[None, :] * stride_wn + ks[:, None], mask=mask, other=0.0)
    return w


@triton.jit
def dot_tile(a, acc, w_base, s_base, rows, k0, K, mask_n, stride_wn, stride_sn, BLOCK_K: tl.constexpr):
    """acc + a @ W[rows, k0:k0 + BLOCK_K]^T for bf16 a [BLOCK_M, BLOCK_K] and MXFP4 W,
    W's packed bytes read as a [BLOCK_K / 2, BLOCK_N] tile and its scales as
    [BLOCK_N, BLOCK_K / 32], as `tl.dot_scaled` takes them. Bytes past K are 0 (+0.0)
    and their scales 127 (1.0): they add nothing. K is a multiple of 32."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    w = tl.load(w_base + rows[None, :] * stride_wn + kb[:, None], mask=(kb < K // 2)[:, None] & mask_n[None, :],
                other=0)
    s = tl.load(s_base + rows[:, None] * stride_sn + kg[None, :], mask=mask_n[:, None] & (kg < K // 32)[None, :],
                other=127)
    return tl.dot_scaled(a, None, "bf16", w, s, "e2m1", acc=acc)
