"""FP8 checkpoints in compressed-tensors' `float-quantized` format, as llmcompressor writes
them (its FP8_DYNAMIC, FP8 and FP8_BLOCK schemes) and vLLM loads them.

quantization_config {"quant_method": "compressed-tensors", "format": "float-quantized",
one config group with weights {float, 8 bits, symmetric, strategy channel | tensor |
block (block_structure [bn, bk])} and input_activations {float, 8 bits: dynamic per
token, static per tensor, or dynamic per group of bk with block weights}}; per projection
`weight` float8_e4m3fn [N, K], `weight_scale` fp32 ([N, 1], [1] or [N/bn, K/bk]: the
multiplier), and `input_scale` [1] when static. The layers are FP8's (backend/models/
fp8.py, fp8_formats.py): the tensors are renamed to Hugging Face's `quant_method: fp8`
layout and read as that is. A kv_cache_scheme is not read: the KV cache follows
kv_cache_dtype.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from backend.models.fp8 import PROJECTIONS
from backend.models.fp8_formats import HF_METHOD, FP8Format, FP8FormatError, FP8Scheme, fp8_state_dict

FORMAT = "float-quantized"
METHOD = "compressed-tensors"


def _require(where: str, args: dict[str, Any], want: dict[str, Any]) -> None:
    for field, value in want.items():
        if args.get(field) != value:
            raise FP8FormatError(f"compressed-tensors float-quantized: {where}.{field} is {args.get(field)!r}, "
                                 f"supported is {value!r}")


class CompressedTensorsFP8Format(FP8Format):
    summary = "compressed-tensors FP8 (float-quantized: per-channel, per-tensor or block-wise weights)"

    def scheme_of(self, quant: dict[str, Any]) -> Optional[FP8Scheme]:
        if quant.get("quant_method") != METHOD:
            return None
        groups = list((quant.get("config_groups") or {}).values())
        if quant.get("format") != FORMAT and not (groups and groups[0].get("format") == FORMAT):
            return None
        if len(groups) != 1:
            raise FP8FormatError(f"compressed-tensors float-quantized with {len(groups)} config_groups: supported "
                                 "is one")
        w, act = groups[0].get("weights") or {}, groups[0].get("input_activations")
        fp8 = {"type": "float", "num_bits": 8, "symmetric": True}
        _require("weights", w, {**fp8, "dynamic": False})
        if act is None:
            raise FP8FormatError("compressed-tensors float-quantized: input_activations is null (weight-only FP8); "
                                 "supported are FP8 activations, dynamic per token or group, or static per tensor")
        _require("input_activations", act, fp8)
        strategy = w.get("strategy")
        if strategy == "block":
            block = w.get("block_structure")
            if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
                raise FP8FormatError(f"compressed-tensors float-quantized: weights.block_structure {block!r}: "
                                     "expected two positive integers [block_n, block_k]")
            _require("input_activations", act, {"dynamic": True, "strategy": "group", "group_size": block[1]})
            return FP8Scheme(METHOD, True, (block[0], block[1]))
        if strategy not in ("channel", "tensor"):
            raise FP8FormatError(f"compressed-tensors float-quantized: weights.strategy {strategy!r}, supported are "
                                 "'channel', 'tensor' and 'block'")
        if act.get("dynamic") is True:
            _require("input_activations", act, {"strategy": "token"})
        else:
            _require("input_activations", act, {"dynamic": False, "strategy": "tensor"})
        return FP8Scheme(METHOD, act.get("dynamic") is True)

    def state_dict(self, state: dict[str, torch.Tensor], num_layers: int, scheme: FP8Scheme
                   ) -> dict[str, torch.Tensor]:
        for i in range(num_layers):
            for proj in PROJECTIONS:
                name = f"model.layers.{i}.{proj}"
                if scheme.block is not None and f"{name}.weight_scale" in state:
                    state[f"{name}.weight_scale_inv"] = state.pop(f"{name}.weight_scale")
                if f"{name}.input_scale" in state:
                    state[f"{name}.input_scale"] = state[f"{name}.input_scale"].float().reshape(())
        return fp8_state_dict(state, num_layers, FP8Scheme(HF_METHOD, scheme.dynamic, scheme.block))
