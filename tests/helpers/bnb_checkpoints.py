"""bitsandbytes 4-bit (NF4 / FP4) checkpoints of the tiny test models, packed as
bitsandbytes packs them. Its CUDA build may not install here, so this transcribes its
torch reference ops (bitsandbytes 0.50 functional.quantize_4bit with
compress_statistics, quantize_blockwise, create_dynamic_map, get_4bit_type,
QuantState.as_dict(packed=True), backends/default/ops.py) in float32;
test_bnb_checkpoints.py compares the bytes with bitsandbytes itself where it imports.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from tests.helpers.int_checkpoints import PROJECTIONS, _copy_base, _set_quant_config

NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]
# FP4 (1 sign, 2 exponent, 1 mantissa bits, bias 2) in code order, normalized by 12.
FP4 = [0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0]


def code_4bit(quant_type: str) -> torch.Tensor:
    data = torch.tensor(NF4 if quant_type == "nf4" else FP4)
    return data / data.abs().max()


def dynamic_map(max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """create_dynamic_map(signed=True): 256 sorted values, a dynamic exponent and fraction."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional_items > 0:
        boundaries = torch.linspace(0.1, 1, additional_items + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data += [0, 1.0]
    data += [0] * (256 - len(data))
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


def _blocks(flat: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(absmax per block, values scaled into [-1, 1]), the last block possibly short."""
    n = flat.numel()
    block = torch.arange(n) // blocksize
    absmax = torch.zeros(int(block[-1]) + 1).scatter_reduce(0, block, flat.abs(), "amax")
    scaled = torch.clamp(flat * (1.0 / absmax.clamp(min=1e-38))[block], -1, 1)
    return absmax, scaled


def quantize_blockwise(x: torch.Tensor, code: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit codes (nearest value of a sorted code) and per-block absmax."""
    absmax, scaled = _blocks(x.reshape(-1).float(), blocksize)
    q = torch.bucketize(scaled, (code[:-1] + code[1:]) / 2, out_int32=True).to(torch.uint8)
    return q, absmax


def quantize_4bit(w: torch.Tensor, quant_type: str, blocksize: int = 64, double_quant: bool = True,
                  nested_blocksize: int = 256) -> dict[str, torch.Tensor]:
    """A Linear4bit's state dict entries for weight w [N, K] (keys relative to `weight`)."""
    code = code_4bit(quant_type)
    absmax, scaled = _blocks(w.reshape(-1).float(), blocksize)
    order = torch.argsort(code)
    q = torch.bucketize(scaled, (code[order[:-1]] + code[order[1:]]) / 2, out_int32=True)
    q = order[q].to(torch.uint8)
    if q.numel() % 2:
        q = torch.cat([q, q.new_zeros(1)])
    out = {"": ((q[::2] << 4) | q[1::2]).unsqueeze(1), ".absmax": absmax, ".quant_map": code}
    meta = {"quant_type": quant_type, "blocksize": blocksize, "dtype": str(w.dtype).replace("torch.", ""),
            "shape": list(w.shape)}
    if double_quant:
        offset = absmax.mean()
        nested = dynamic_map()
        qa, absmax2 = quantize_blockwise(absmax - offset, nested, nested_blocksize)
        out.update({".absmax": qa, ".nested_absmax": absmax2, ".nested_quant_map": nested})
        meta.update(nested_blocksize=nested_blocksize, nested_dtype="float32", nested_offset=offset.item())
    out[f".quant_state.bitsandbytes__{quant_type}"] = torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)
    return out


def write_bnb(base: str, path: str, quant_type: str = "nf4", double_quant: bool = True) -> str:
    """The base checkpoint with every decoder projection 4-bit, as transformers saves a
    model loaded with BitsAndBytesConfig(load_in_4bit=True, ...)."""
    state = _copy_base(base, path)
    for name in sorted({k[:-len(".weight")] for k in state if k.endswith(".weight")}):
        if name.split(".", 3)[-1] not in PROJECTIONS:
            continue
        for suffix, t in quantize_4bit(state.pop(f"{name}.weight"), quant_type, double_quant=double_quant).items():
            state[f"{name}.weight{suffix}"] = t
    save_file(state, os.path.join(path, "model.safetensors"))
    _set_quant_config(path, {"quant_method": "bitsandbytes", "_load_in_4bit": True, "_load_in_8bit": False,
                             "load_in_4bit": True, "load_in_8bit": False, "bnb_4bit_quant_type": quant_type,
                             "bnb_4bit_use_double_quant": double_quant, "bnb_4bit_compute_dtype": "float32",
                             "bnb_4bit_quant_storage": "uint8", "llm_int8_skip_modules": None,
                             "llm_int8_threshold": 6.0, "llm_int8_has_fp16_weight": False,
                             "llm_int8_enable_fp32_cpu_offload": False})
    return path
