"""MXFP4 packing transcribed from the OCP Microscaling Formats (MX) v1.0 spec, for tests:
a test-side writer independent of backend/ops/mxfp4.py (which reads).

Spec, section 6.3 (conversion from a vector of 32 floats V): shared exponent
X = floor(log2(max |V|)) - emax_elem, with emax_elem = 2 for FP4 E2M1; scale byte
E8M0 = X + 127; each P_i = V_i / 2^X rounded to the nearest E2M1 value (ties to even
mantissa) and clamped to +-6. E2M1 codes: sign bit 3, exponent bits 2..1 (bias 1),
mantissa bit 0: 0b0000..0b0111 = 0, 0.5, 1, 1.5, 2, 3, 4, 6.
gpt-oss's checkpoint layout: two codes a byte, element 2j in the low nibble of byte j;
blocks [.., out, in / 32, 16], scales [.., out, in / 32].
"""

from __future__ import annotations

import torch

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _nearest_code(mag: torch.Tensor) -> torch.Tensor:
    """Magnitudes (already divided by the scale) -> 3-bit codes, nearest, ties to the
    even code (the even mantissa)."""
    grid = torch.tensor(E2M1)
    dist = (mag[..., None] - grid).abs()
    best = dist.min(dim=-1, keepdim=True).values
    ties = dist == best
    even = ties & (torch.arange(8) % 2 == 0)
    return torch.where(even.any(-1), even.float().argmax(-1), ties.float().argmax(-1))


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[.., out, in] float -> (blocks uint8 [.., out, in / 32, 16], scales uint8 [.., out, in / 32])."""
    *lead, n_in = w.shape
    v = w.float().reshape(*lead, n_in // 32, 32)
    amax = v.abs().amax(dim=-1)
    x = torch.floor(torch.log2(amax.clamp(min=2.0 ** -127))) - 2
    x = x.clamp(-127, 127)
    p = v / torch.exp2(x)[..., None]
    code = _nearest_code(p.abs().clamp(max=6.0)) | ((p < 0).long() << 3)
    code = code.to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks, (x + 127).to(torch.uint8)


def unpack_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The spec's value X * P, by table: [.., out, in] fp32."""
    table = torch.tensor(E2M1 + [-v for v in E2M1])
    lo, hi = table[(blocks & 0xF).long()], table[(blocks >> 4).long()]
    p = torch.stack([lo, hi], dim=-1).flatten(-2)
    return (p * torch.exp2(scales.float() - 127)[..., None]).flatten(-2)
