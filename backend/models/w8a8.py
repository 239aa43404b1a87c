"""W8A8 INT8 linear layers: per-output-channel symmetric INT8 weights, dynamic per-token
symmetric INT8 activations, an int8 x int8 -> int32 GEMM scaled by both.

Checkpoint format: compressed-tensors `int-quantized`, as llmcompressor writes W8A8
(SmoothQuant + GPTQ/RTN) and as `python -m builder build --weights w8a8` writes it:
config.json's quantization_config {"quant_method": "compressed-tensors", "format":
"int-quantized", one config group with weights {int, 8 bits, symmetric, strategy channel
(or tensor)} and input_activations {int, 8 bits, symmetric, dynamic, strategy token}};
per projection `weight` int8 [N, K] and `weight_scale` [N, 1] (a symmetric zero point,
when saved, is all zeros). SmoothQuant needs nothing at load: its smoothing is folded into
the weights and the preceding norms.

Activations are quantized as vLLM's dynamic per-token int8 quant does: scale = max|x| /
127 per token, q = round-half-even(x / scale) clamped to [-128, 127].

On CUDA (and with attention_backend="triton") the GEMM is the Triton kernel of
backend/ops/w8a8_gemm_triton.py; elsewhere int8_gemm_reference computes the same
integers exactly (torch._int_mm's int32 sums on CPU, float64 elsewhere) and applies the
same fp32 epilogue.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from backend.models.fp8 import PROJECTIONS, replace_projections
from backend.models.int_formats import IntFormatError
from backend.models.weight_format import WeightFormat

FORMAT = "int-quantized"
INT8_MAX = 127.0


def is_w8a8(quant: Optional[dict[str, Any]]) -> bool:
    """Whether quantization_config is compressed-tensors W8A8 INT8 (int-quantized); an
    error naming the field when it is int-quantized in a variant we do not run."""
    if not quant or quant.get("quant_method") != "compressed-tensors":
        return False
    groups = list((quant.get("config_groups") or {}).values())
    if quant.get("format") != FORMAT and not (groups and groups[0].get("format") == FORMAT):
        return False
    if len(groups) != 1:
        raise IntFormatError(f"compressed-tensors int-quantized with {len(groups)} config_groups: supported is one")
    w, act = groups[0].get("weights") or {}, groups[0].get("input_activations") or {}
    want_w = {"type": "int", "num_bits": 8, "symmetric": True}
    for field, want in want_w.items():
        if w.get(field) != want:
            raise IntFormatError(f"compressed-tensors int-quantized: weights.{field} is {w.get(field)!r}, "
                                 f"supported is {want!r} (W8A8 INT8, symmetric)")
    if w.get("strategy") not in ("channel", "tensor"):
        raise IntFormatError(f"compressed-tensors int-quantized: weights.strategy {w.get('strategy')!r}, supported "
                             "are 'channel' and 'tensor'")
    for field, want in {**want_w, "dynamic": True, "strategy": "token"}.items():
        if act.get(field) != want:
            raise IntFormatError(f"compressed-tensors int-quantized: input_activations.{field} is "
                                 f"{act.get(field)!r}, supported is {want!r} (dynamic per-token INT8)")
    return True


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], fp32 scale [M]) with x ~= q * scale[:, None]."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp(min=1e-10) / INT8_MAX
    q = torch.round(xf / scale[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scale


# |x| <= 128 and |w| <= 128: K products of at most 2^14 each sum below 2^31 for K below this.
INT32_EXACT_K = 2 ** 31 // 2 ** 14


def int8_matmul_exact(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """xq [M, K] int8 @ wq [N, K]^T as the exact int32 sums (the kernel's accumulator).
    On CPU torch._int_mm accumulates in int32 (no sum can overflow for K below
    INT32_EXACT_K), 3-10x faster than float64 BLAS at the engine's shapes; elsewhere
    (CUDA's _int_mm wants M > 16 and aligned shapes) float64, which holds every such sum."""
    if xq.device.type == "cpu" and xq.shape[-1] < INT32_EXACT_K and hasattr(torch, "_int_mm"):
        return torch._int_mm(xq, wq.t())
    return (xq.double() @ wq.double().t()).to(torch.int32)


def int8_gemm_reference(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                        bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """The exact integer product (int8_matmul_exact), then the kernel's epilogue:
    fp32 acc * x_scale * w_scale (+ bias), one rounding to out_dtype."""
    acc = int8_matmul_exact(xq, wq).float()
    out = acc * x_scale[:, None] * w_scale[None, :]
    if bias is not None:
        out = out + bias.float()[None, :]
    return out.to(out_dtype)


class W8A8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, use_kernel: bool) -> None:
        super().__init__()
        self.in_features, self.out_features, self.use_kernel = in_features, out_features, use_kernel
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.use_kernel or x.is_cuda:
            # One launch for the per-token rounding, equal to quantize_per_token bit for bit.
            from backend.ops.quant_rows_triton import quantize_rows
            from backend.ops.w8a8_gemm_triton import w8a8_gemm
            xq, x_scale = quantize_rows(x2.contiguous(), fp8=False)
            out = w8a8_gemm(xq, x_scale, self.weight, self.weight_scale, self.bias, x.dtype)
        else:
            xq, x_scale = quantize_per_token(x2)
            out = int8_gemm_reference(xq, x_scale, self.weight, self.weight_scale, self.bias, x.dtype)
        return out.reshape(*shape[:-1], self.out_features)


def swap_in_w8a8_linears(model: nn.Module, use_kernel: bool) -> None:
    """The decoder's projections (not embeddings or the LM head) as W8A8Linear."""
    replace_projections(model, lambda k, n, bias: W8A8Linear(k, n, bias, use_kernel))


def w8a8_state_dict(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """The checkpoint's W8A8 projections with fp32 per-channel scales [N] (a per-tensor
    scale expanded), zero points dropped; fuse_projections then concatenates q/k/v and
    gate/up as for any checkpoint."""
    for i in range(num_layers):
        for proj in PROJECTIONS:
            name = f"model.layers.{i}.{proj}"
            w, scale = state.get(f"{name}.weight"), state.get(f"{name}.weight_scale")
            if w is None:
                continue
            if w.dtype != torch.int8 or scale is None:
                raise IntFormatError(f"compressed-tensors int-quantized: '{name}' is not quantized (int8 weight "
                                     "and weight_scale); every decoder projection must be")
            zp = state.pop(f"{name}.weight_zero_point", None)
            if zp is not None and bool(zp.ne(0).any()):
                raise IntFormatError(f"compressed-tensors int-quantized: '{name}.weight_zero_point' is not zero "
                                     "(asymmetric weights are not supported)")
            state[f"{name}.weight_scale"] = scale.float().reshape(-1).expand(w.shape[0]).contiguous()
    return state


class W8A8Format(WeightFormat):
    summary = "compressed-tensors W8A8 INT8 (int-quantized)"
    linear_classes = (W8A8Linear,)

    def scheme_of(self, quant: dict[str, Any]) -> Optional[str]:
        return FORMAT if is_w8a8(quant) else None

    def describe(self, scheme: str) -> str:
        return "compressed-tensors W8A8 INT8"

    def swap_in(self, model: nn.Module, scheme: str, use_kernel: bool) -> None:
        swap_in_w8a8_linears(model, use_kernel)

    def state_dict(self, state: dict[str, torch.Tensor], num_layers: int, scheme: str) -> dict[str, torch.Tensor]:
        return w8a8_state_dict(state, num_layers)
