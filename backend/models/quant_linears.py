"""Which quantized linear layers a checkpoint's quantization_config asks for, in one
place: FP8 (ours, and Hugging Face / vLLM per-tensor or block-wise), weight-only
INT4/INT8 (compressed-tensors pack-quantized, GPTQ, AWQ) and W8A8 INT8
(compressed-tensors int-quantized). The loader swaps them in on the meta model and
converts the checkpoint's tensors to their parameters."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from backend.models.fp8 import FP8Linear, swap_in_fp8_linears
from backend.models.fp8_formats import FP8BlockLinear, fp8_scheme_of, fp8_state_dict, swap_in_fp8_block_linears
from backend.models.int_formats import scheme_of
from backend.models.int_linear import IntLinear, int_state_dict, swap_in_int_linears
from backend.models.w8a8 import W8A8Linear, is_w8a8, swap_in_w8a8_linears, w8a8_state_dict

QUANTIZED_LINEARS = (FP8Linear, FP8BlockLinear, IntLinear, W8A8Linear)


def describe(quant: Optional[dict[str, Any]]) -> Optional[str]:
    """A short name of the checkpoint's scheme (None: not quantized); raises the format's
    ValueError naming the field for a variant the engine does not run."""
    if not quant:
        return None
    if is_w8a8(quant):
        return "compressed-tensors W8A8 INT8"
    int_scheme = scheme_of(quant)
    if int_scheme is not None:
        return f"{int_scheme.method} INT{int_scheme.bits}"
    fp8 = fp8_scheme_of(quant)
    if fp8 is not None:
        return f"{fp8.method} FP8" + (" block-wise" if fp8.block else "") + (" dynamic" if fp8.dynamic else "")
    return None


def swap_in_quantized_linears(model: nn.Module, quant: Optional[dict[str, Any]], int_kernel: bool) -> None:
    """Replace the decoder's projections (on the meta model) by the layers `quant` needs."""
    if not quant:
        return
    if is_w8a8(quant):
        swap_in_w8a8_linears(model, use_kernel=int_kernel)
    elif (int_scheme := scheme_of(quant)) is not None:
        swap_in_int_linears(model, int_scheme, use_kernel=int_kernel)
    elif (fp8 := fp8_scheme_of(quant)) is not None:
        if fp8.block is not None:
            swap_in_fp8_block_linears(model, fp8.block, use_kernel=int_kernel)
        else:
            swap_in_fp8_linears(model, dynamic=fp8.dynamic)


def quantized_state_dict(state: dict[str, torch.Tensor], num_layers: int,
                         quant: Optional[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The checkpoint's quantized tensors as those layers' parameters (before fusing)."""
    if not quant:
        return state
    if is_w8a8(quant):
        return w8a8_state_dict(state, num_layers)
    if (int_scheme := scheme_of(quant)) is not None:
        return int_state_dict(state, num_layers, int_scheme)
    if (fp8 := fp8_scheme_of(quant)) is not None:
        return fp8_state_dict(state, num_layers, fp8)
    return state


def single_rank_only(quant: Optional[dict[str, Any]]) -> Optional[str]:
    """The scheme's name if its layers have no tensor-parallel sharding (all but our own
    per-channel FP8 builds), else None."""
    name = describe(quant)
    if name is None or (quant.get("quant_method") == "paged_llm_fp8"):
        return None
    return name
