"""MXFP4 weights (OCP Microscaling Formats v1.0, the MXFP4 concrete format) as gpt-oss
publishes its expert tensors, dequantized exactly.

The format: blocks of 32 consecutive elements along the reduction (input) dimension
share one scale X, an E8M0 byte (2^(s - 127); s = 255 is NaN); each element P is FP4
E2M1 (1 sign, 2 exponent bits with bias 1, 1 mantissa bit: values 0, 0.5, 1, 1.5, 2,
3, 4, 6 and their negatives; exponent 0 is subnormal, m * 0.5). The value is X * P.

The checkpoint layout (gpt-oss, read by transformers' integrations/mxfp4.py): for a
weight of [.., out, in], `<name>_blocks` is uint8 [.., out, in / 32, 16], two elements a
byte, the element of even index in the low nibble; `<name>_scales` is uint8
[.., out, in / 32]. Every product is a power of two times a 2-bit significand, so the
result is exact in bf16 and fp32 alike (no rounding), whichever dtype is asked for.
"""

from __future__ import annotations

import torch

BLOCK = 32      # elements per shared scale


class MXFP4Error(ValueError):
    pass


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """FP4 E2M1 codes (0..15, uint8/int) -> fp32, from the bit fields."""
    codes = codes.to(torch.int32)
    sign = torch.where((codes >> 3) & 1 == 1, -1.0, 1.0)
    exp = (codes >> 1) & 0b11
    mant = (codes & 1).to(torch.float32)
    normal = (1.0 + 0.5 * mant) * torch.exp2((exp - 1).to(torch.float32))
    return sign * torch.where(exp == 0, 0.5 * mant, normal)


def e8m0_scales(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 2^(s - 127) (s = 255: NaN, as the spec says)."""
    s = scales.to(torch.int32)
    out = torch.exp2((s - 127).to(torch.float32))
    return torch.where(s == 255, torch.full_like(out, float("nan")), out)


# Rows of 32 values decoded at once: bounds the transient index tensors (a published
# gpt-oss-120b layer has 1.2e8 such rows).
CHUNK_ROWS = 1 << 20


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[.., out, in / 32, 16] packed bytes and [.., out, in / 32] scales -> [.., out, in]
    in dtype (float32 or bfloat16: both hold every MXFP4 value exactly, as their
    exponent range is E8M0's)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise MXFP4Error(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise MXFP4Error(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(expected blocks [.., G, {BLOCK // 2}] and scales [.., G])")
    if dtype not in (torch.float32, torch.bfloat16):
        raise MXFP4Error(f"MXFP4 dequantizes exactly to float32 or bfloat16, not {dtype}")
    # Each byte value -> its two elements: element 2j is the low nibble of byte j,
    # element 2j + 1 the high one.
    byte = torch.arange(256, device=blocks.device)
    pairs = torch.stack([e2m1_values(byte & 0x0F), e2m1_values(byte >> 4)], dim=-1).to(dtype)   # [256, 2]
    flat, flat_scales = blocks.reshape(-1, BLOCK // 2), scales.reshape(-1)
    out = torch.empty(flat.shape[0], BLOCK, dtype=dtype, device=blocks.device)
    for r0 in range(0, flat.shape[0], CHUNK_ROWS):
        rows = slice(r0, r0 + CHUNK_ROWS)
        out[rows] = pairs[flat[rows].long()].view(-1, BLOCK)
        out[rows] *= e8m0_scales(flat_scales[rows]).to(dtype)[:, None]   # a power of two: exact
    return out.view(*scales.shape[:-1], -1)


def dequantize_experts(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Replace `<prefix>.<proj>_blocks` / `_scales` with the dequantized `<prefix>.<proj>`
    in bf16 (exact; the loader casts to the compute dtype, exactly too), in the
    checkpoint's [E, out, in] orientation (in place)."""
    for proj in ("gate_up_proj", "down_proj"):
        blocks, scales = state.pop(f"{prefix}.{proj}_blocks", None), state.pop(f"{prefix}.{proj}_scales", None)
        if blocks is None and scales is None:
            continue
        if blocks is None or scales is None:
            raise MXFP4Error(f"{prefix}.{proj}: MXFP4 needs both _blocks and _scales")
        state[f"{prefix}.{proj}"] = dequantize(blocks, scales, torch.bfloat16)
    return state
