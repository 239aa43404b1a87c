"""Torch references of the fused layer ops: the definition the Triton kernels
(triton_kernels.py) and the CPU's C++ ops (cpu_layer_ops.py) are tested against, and
what runs on CPU wherever those do not apply.

Each follows Hugging Face's modules operation for operation, so fp32 results match
transformers bit for bit: RMSNorm normalizes in fp32, casts to the activation dtype,
then multiplies by the weight; RoPE casts cos/sin to the activation dtype; the residual
add happens in the activation dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's order: normalize in fp32, round, multiply by the weight. An fp32 weight on
    narrower activations (gpt-oss keeps its norms in fp32, as transformers does)
    multiplies first and rounds once."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32 and dtype != torch.float32:
        return (weight * xf).to(dtype)
    return weight * xf.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual); with no residual, (RMSNorm(x), x)."""
    if residual is not None:
        x = x + residual
    return rms_norm(x, weight, eps), x


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
           sin_cache: torch.Tensor, q_norm: Optional[torch.Tensor] = None, k_norm: Optional[torch.Tensor] = None,
           eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, KVH, D]; optional per-head RMSNorm weights (Qwen3) applied
    first; rotate-half layout. Tables narrower than D (partial_rotary_factor) rotate the
    first channels and pass the rest, as transformers' Phi-3 does. Returns new tensors."""
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    cos = cos_cache[positions].to(q.dtype).unsqueeze(1)
    sin = sin_cache[positions].to(q.dtype).unsqueeze(1)
    rd = cos.shape[-1]
    if rd < q.shape[-1]:
        return (torch.cat([q[..., :rd] * cos + _rotate_half(q[..., :rd]) * sin, q[..., rd:]], dim=-1),
                torch.cat([k[..., :rd] * cos + _rotate_half(k[..., :rd]) * sin, k[..., rd:]], dim=-1))
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def act_and_mul(x: torch.Tensor, act: str) -> torch.Tensor:
    """x = [gate | up] ([T, 2I]) -> act(gate) * up ([T, I])."""
    half = x.shape[-1] // 2
    return ACTIVATIONS[act](x[..., :half]) * x[..., half:]
