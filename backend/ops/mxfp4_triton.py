"""MXFP4 weight tiles decoded in registers, for the fused MoE grouped GEMM
(fused_moe_triton.py): gpt-oss's experts kept 4-bit on the device.

The format is backend/ops/mxfp4.py's (OCP MX v1.0): per output row, bytes of two
E2M1 codes (element 2j in the low nibble of byte j) and one E8M0 scale byte per 32
inputs. A [BLOCK_K, BLOCK_N] tile of W^T is read as its bytes (each byte twice: the
two k of a pair) and its scales (one per 32 k), decoded from the bit fields and scaled
by 2^(s - 127); every value is exact in bf16 and fp32, so the tile feeds tl.dot like a
loaded one (Hopper has no FP4 MMA: bf16 tiles on tensor cores). Memory read per weight:
4.25 bits instead of 16.
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
