"""FP8 (E4M3) linear layers: per-output-channel weight scales, and a static per-tensor
activation scale or dynamic per-token ones.

Checkpoint format (written by `python -m builder build --weights fp8`): for every
quantized linear `<name>.weight` is float8_e4m3fn, with `<name>.weight_scale` (fp32,
[out]) and, for static activations, `<name>.input_scale` (fp32, scalar); config.json
carries `quantization_config = {"quant_method": "paged_llm_fp8", "activation_scheme":
"static" | "dynamic", ...}` with the calibrated per-layer KV-cache scales. Dynamic: each
token's activation row gets scale max|x| / 448 at run time (vLLM's per-token dynamic FP8).
Hugging Face / vLLM `quant_method: fp8` checkpoints load into the same layer
(backend/models/fp8_formats.py), block-wise ones into FP8BlockLinear there.

On CUDA the matmul is torch._scaled_mm on FP8 tensor cores (Hopper). Elsewhere the same
numerics are emulated: the activation is rounded through FP8 with its scale and
multiplied by the dequantized weight (kept dequantized in memory: the CPU path is for
correctness, the checkpoint is what is halved).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from backend.ops.fp8_quant import FP8_MAX

QUANT_METHOD = "paged_llm_fp8"
# Checkpoint names (Hugging Face's, what the builder quantizes) and the engine's fused ones.
QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# The quantized projections by their checkpoint names under `model.layers.<i>.`.
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (fp8 weight, fp32 scale [out]) with w ~= fp8 * scale[:, None]."""
    amax = w.float().abs().amax(dim=1).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round x through FP8 with a scale broadcast against it (per tensor, or [M, 1] per
    token): what the FP8 GEMM's input sees."""
    return ((x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


def per_token_scale(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token activation scales [..., 1]: max |x| of each row / 448."""
    return x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX


class FP8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dynamic: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
        # None: dynamic per-token scales, computed from each input.
        self.input_scale = None if dynamic else nn.Parameter(torch.empty((), dtype=torch.float32),
                                                             requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self._dequantized: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dim() == 2:
            return self._scaled_mm(x)
        if self._dequantized is None or self._dequantized.dtype != x.dtype:
            self._dequantized = (self.weight.float() * self.weight_scale[:, None]).to(x.dtype)
        scale = per_token_scale(x) if self.input_scale is None else self.input_scale
        return F.linear(fake_quantize(x, scale), self._dequantized,
                        None if self.bias is None else self.bias.to(x.dtype))

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        # One launch for the rounding (per token, or by the static scale), equal to the
        # emulated path's: backend/ops/quant_rows_triton.py.
        from backend.ops.quant_rows_triton import quantize_rows
        xq, scale = quantize_rows(x.contiguous(), fp8=True, static_scale=self.input_scale)
        scale_a = scale.reshape(-1, 1).expand(x.shape[0], 1).contiguous()
        scale_b = self.weight_scale[None, :].contiguous()
        # cuBLAS takes a bias only with a 16-bit output (fp32: "Bias is not supported when
        # out_dtype is set to Float32", seen on an H100): an fp32 model adds it after.
        fused_bias = self.bias is not None and x.dtype != torch.float32
        out = torch._scaled_mm(xq, self.weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=x.dtype,
                               bias=self.bias.to(x.dtype) if fused_bias else None)
        return out if self.bias is None or fused_bias else out + self.bias


def replace_projections(model: nn.Module, make: Callable[[int, int, bool], nn.Module]) -> None:
    """Replace the decoder's (fused) projections, not embeddings or the LM head, by
    make(in_features, out_features, has_bias), on the device of the layer replaced."""
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in FUSED_LINEARS:
                lin = getattr(parent, name, None)
                if isinstance(lin, nn.Linear):
                    with torch.device(lin.weight.device):
                        setattr(parent, name, make(lin.in_features, lin.out_features, lin.bias is not None))


def swap_in_fp8_linears(model: nn.Module, dynamic: bool = False) -> None:
    """The decoder's projections as FP8Linear (dynamic: per-token activation scales)."""
    replace_projections(model, lambda k, n, bias: FP8Linear(k, n, bias, dynamic))
