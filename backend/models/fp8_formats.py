"""FP8 checkpoints as Hugging Face and vLLM write them (`quant_method: fp8`), besides our
own `paged_llm_fp8` builds (backend/models/fp8.py).

quantization_config {"quant_method": "fp8", "activation_scheme": "static" | "dynamic",
"weight_block_size": null | [block_n, block_k], "fmt": "e4m3"}:
- per-tensor (no weight_block_size; AutoFP8 / vLLM's format): `weight` float8_e4m3fn
  [N, K], `weight_scale` fp32 (a scalar, or per channel), `input_scale` (static only).
  w = weight * weight_scale. Loaded into FP8Linear with the scale per channel.
- block-wise (DeepSeek-V3, Qwen3-FP8; transformers' FineGrainedFP8): `weight` float8_e4m3fn
  [N, K], `weight_scale_inv` fp32 [ceil(N/block_n), ceil(K/block_k)]: despite its name
  the multiplier, w[n, k] = weight[n, k] * weight_scale_inv[n // block_n, k // block_k].
  Activations are dynamic, quantized per token and per group of block_k channels
  (DeepSeek-V3's act_quant, vLLM's per_token_group_quant_fp8). Loaded into FP8BlockLinear,
  whose scales are expanded to one row per output channel [N, ceil(K/block_k)] so that
  q/k/v and gate/up concatenate whatever their sizes (a 1/block_k-size overhead).

On CUDA (and with attention_backend="triton") FP8BlockLinear runs the Triton kernel of
backend/ops/fp8_block_gemm_triton.py (weights stay FP8 in memory). Its torch path (CPU)
dequantizes the weight exactly once and rounds each activation group through E4M3 with
its scale: the numerics the kernel computes, in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from backend.models.fp8 import PROJECTIONS, QUANT_METHOD, FP8Linear, replace_projections, swap_in_fp8_linears
from backend.models.weight_format import WeightFormat
from backend.ops.fp8_quant import quantize_per_group

HF_METHOD = "fp8"


class FP8FormatError(ValueError):
    pass


@dataclass(frozen=True)
class FP8Scheme:
    method: str                                     # "paged_llm_fp8" or "fp8"
    dynamic: bool                                   # per-token (per-group with blocks) activation scales
    block: Optional[tuple[int, int]] = None         # (block_n, block_k) of the weight scales


def fp8_scheme_of(quant: Optional[dict[str, Any]]) -> Optional[FP8Scheme]:
    """The checkpoint's FP8 scheme; None if it is not FP8; an error naming the field for
    FP8 variants we do not run."""
    method = (quant or {}).get("quant_method")
    if method not in (QUANT_METHOD, HF_METHOD):
        return None
    scheme = quant.get("activation_scheme", "static")
    if scheme not in ("static", "dynamic"):
        raise FP8FormatError(f"fp8 quantization_config.activation_scheme {scheme!r}: supported are 'static' and "
                             "'dynamic'")
    if method == QUANT_METHOD:
        return FP8Scheme(method, scheme == "dynamic")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise FP8FormatError(f"fp8 quantization_config.fmt {quant.get('fmt')!r}: supported is 'e4m3'")
    block = quant.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                            for b in block)):
            raise FP8FormatError(f"fp8 quantization_config.weight_block_size {block!r}: expected two positive "
                                 "integers [block_n, block_k]")
        if scheme != "dynamic":
            raise FP8FormatError("fp8 quantization_config.weight_block_size needs activation_scheme 'dynamic' "
                                 "(block-wise activations are quantized at run time)")
        block = (block[0], block[1])
    return FP8Scheme(method, scheme == "dynamic", block)


def per_group_fake_quantize(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., K] rounded through E4M3 per token and group (what the block GEMM's input is)."""
    q, scale = quantize_per_group(x.reshape(-1, x.shape[-1]), group)
    deq = q.float() * scale.repeat_interleave(group, dim=1)[:, :x.shape[-1]]
    return deq.to(x.dtype).reshape(x.shape)


def dequantize_block(weight: torch.Tensor, row_scales: torch.Tensor, block_k: int) -> torch.Tensor:
    """weight fp8 [N, K], row_scales [N, ceil(K/block_k)] -> fp32 [N, K]."""
    K = weight.shape[1]
    return weight.float() * row_scales.float().repeat_interleave(block_k, dim=1)[:, :K]


class FP8BlockLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, block: tuple[int, int],
                 use_kernel: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block_k = in_features, out_features, block[1]
        self.use_kernel = use_kernel
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, -(-in_features // block[1]), dtype=torch.float32),
                                         requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self._dequantized: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel or x.is_cuda:
            from backend.ops.fp8_block_gemm_triton import fp8_block_gemm
            out = fp8_block_gemm(x.reshape(-1, x.shape[-1]), self.weight, self.weight_scale, self.block_k, self.bias)
            return out.reshape(*x.shape[:-1], self.out_features)
        if self._dequantized is None or self._dequantized.dtype != x.dtype:
            self._dequantized = dequantize_block(self.weight, self.weight_scale, self.block_k).to(x.dtype)
        return F.linear(per_group_fake_quantize(x, self.block_k), self._dequantized,
                        None if self.bias is None else self.bias.to(x.dtype))


def swap_in_fp8_block_linears(model: nn.Module, block: tuple[int, int], use_kernel: bool) -> None:
    replace_projections(model, lambda k, n, bias: FP8BlockLinear(k, n, bias, block, use_kernel))


def fp8_state_dict(state: dict[str, torch.Tensor], num_layers: int, scheme: FP8Scheme) -> dict[str, torch.Tensor]:
    """A `quant_method: fp8` checkpoint's projections as the engine's layers want them:
    per-channel fp32 `weight_scale` [N] (per-tensor), or per-row block scales
    [N, ceil(K/block_k)] (block-wise). fuse_projections then concatenates q/k/v, gate/up."""
    if scheme.method != HF_METHOD:
        return state
    for i in range(num_layers):
        for proj in PROJECTIONS:
            name = f"model.layers.{i}.{proj}"
            w = state.get(f"{name}.weight")
            if w is None:
                continue
            if w.dtype != torch.float8_e4m3fn:
                raise FP8FormatError(f"fp8 checkpoint: '{name}.weight' is {w.dtype}, not float8_e4m3fn (every "
                                     "decoder projection must be quantized)")
            N, K = w.shape
            if scheme.block is None:
                scale = state.get(f"{name}.weight_scale")
                if scale is None:
                    raise FP8FormatError(f"fp8 checkpoint: '{name}.weight_scale' is missing")
                state[f"{name}.weight_scale"] = scale.float().reshape(-1).expand(N).contiguous()
                if scheme.dynamic:
                    state.pop(f"{name}.input_scale", None)
                elif f"{name}.input_scale" not in state:
                    raise FP8FormatError(f"fp8 checkpoint: activation_scheme 'static' but '{name}.input_scale' is "
                                         "missing")
                continue
            bn, bk = scheme.block
            inv = state.pop(f"{name}.weight_scale_inv", None)
            grid = (-(-N // bn), -(-K // bk))
            if inv is None or tuple(inv.shape) != grid:
                raise FP8FormatError(f"fp8 checkpoint: '{name}.weight_scale_inv' should be {list(grid)} for a "
                                     f"[{N}, {K}] weight and weight_block_size [{bn}, {bk}], got "
                                     f"{None if inv is None else list(inv.shape)}")
            state[f"{name}.weight_scale"] = inv.float().repeat_interleave(bn, dim=0)[:N].contiguous()
    return state


class FP8Format(WeightFormat):
    summary = ("FP8 builds made by `python -m builder build --weights fp8`, fp8 (per-tensor or block-wise, "
               "as Hugging Face and vLLM write it)")
    linear_classes = (FP8Linear, FP8BlockLinear)

    def scheme_of(self, quant: dict[str, Any]) -> Optional[FP8Scheme]:
        return fp8_scheme_of(quant)

    def describe(self, scheme: FP8Scheme) -> str:
        return f"{scheme.method} FP8" + (" block-wise" if scheme.block else "") + (" dynamic" if scheme.dynamic else "")

    def swap_in(self, model: nn.Module, scheme: FP8Scheme, use_kernel: bool) -> None:
        if scheme.block is not None:
            swap_in_fp8_block_linears(model, scheme.block, use_kernel)
        else:
            swap_in_fp8_linears(model, dynamic=scheme.dynamic)

    def state_dict(self, state: dict[str, torch.Tensor], num_layers: int, scheme: FP8Scheme
                   ) -> dict[str, torch.Tensor]:
        return fp8_state_dict(state, num_layers, scheme)

    def tensor_parallel(self, scheme: FP8Scheme) -> bool:
        return scheme.method == QUANT_METHOD        # our builds' per-channel scales shard with their rows
