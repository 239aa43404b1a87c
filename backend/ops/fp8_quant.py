"""FP8 (E4M3) quantization math that kernels and models share: activations per token
and channel group (the block GEMM's input), and expert stacks back to fp32. Torch only,
below the models that use it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)     # 448


def quantize_per_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (E4M3 [M, K], fp32 scales [M, ceil(K/group)]): one scale per token and
    group of `group` channels, max |x| of the group / 448; the last group may be shorter."""
    M, K = x.shape
    pad = (-K) % group
    xp = F.pad(x.float(), (0, pad)).reshape(M, -1, group)
    scale = xp.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    q = (xp / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(M, K + pad)[:, :K]
    return q.contiguous(), scale


def dequantize_experts(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The exact fp32 value of an FP8 expert stack: fp8 * scale per expert and channel."""
    return q.float() * scale.float()[..., None]
