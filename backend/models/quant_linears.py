"""The weight formats the engine reads, in the order they are asked (each one's
scheme_of returns None for a checkpoint that is not its own): one class per format
(backend/models/weight_format.py). A new format: its module and a line in FORMATS.

The loader swaps a format's layers in on the meta model and converts the checkpoint's
tensors to their parameters; config reading rejects a quantization_config no format
reads, naming what is supported."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from backend.models.ct_fp8 import CompressedTensorsFP8Format
from backend.models.fp8_formats import FP8Format
from backend.models.int_linear import IntFormat
from backend.models.w8a8 import W8A8Format
from backend.models.weight_format import WeightFormat

FORMATS: tuple[WeightFormat, ...] = (
    W8A8Format(),
    IntFormat(),
    FP8Format(),
    CompressedTensorsFP8Format(),
)

QUANTIZED_LINEARS = tuple(dict.fromkeys(cls for fmt in FORMATS for cls in fmt.linear_classes))


class UnknownWeightFormat(ValueError):
    pass


def find_format(quant: Optional[dict[str, Any]]) -> Optional[tuple[WeightFormat, Any]]:
    """(the format, its scheme) of a quantization_config; None when there is none;
    UnknownWeightFormat when no format reads it (a format's own error when one reads it
    in a variant the engine does not run)."""
    if not quant:
        return None
    for fmt in FORMATS:
        scheme = fmt.scheme_of(quant)
        if scheme is not None:
            return fmt, scheme
    variant = f" format {quant['format']!r}" if quant.get("format") else ""
    raise UnknownWeightFormat(f"quant_method {quant.get('quant_method')!r}{variant} is not one the engine reads "
                              f"(supported: {'; '.join(fmt.summary for fmt in FORMATS)})")


def describe(quant: Optional[dict[str, Any]]) -> Optional[str]:
    """A short name of the checkpoint's scheme (None: not quantized)."""
    found = find_format(quant)
    return None if found is None else found[0].describe(found[1])


def swap_in_quantized_linears(model: nn.Module, quant: Optional[dict[str, Any]], int_kernel: bool) -> None:
    """Replace the decoder's projections (on the meta model) by the layers `quant` needs."""
    found = find_format(quant)
    if found is not None:
        found[0].swap_in(model, found[1], int_kernel)


def quantized_state_dict(state: dict[str, torch.Tensor], num_layers: int,
                         quant: Optional[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The checkpoint's quantized tensors as those layers' parameters (before fusing)."""
    found = find_format(quant)
    return state if found is None else found[0].state_dict(state, num_layers, found[1])


def single_rank_only(quant: Optional[dict[str, Any]]) -> Optional[str]:
    """The scheme's name if its layers have no tensor-parallel sharding, else None."""
    found = find_format(quant)
    if found is None or found[0].tensor_parallel(found[1]):
        return None
    return found[0].describe(found[1])
