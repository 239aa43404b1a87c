"""bitsandbytes 4-bit checkpoints (NF4 and FP4, QLoRA's format) as transformers saves
them, read into the one INT layout of int_formats.py with a lookup table.

Format (bitsandbytes' functional.quantize_4bit / QuantState.as_dict(packed=True), the
`Linear4bit` state dict; transcribed from its source, since its CUDA build may not
install here):
- config.json: `quantization_config` {quant_method: bitsandbytes, load_in_4bit: true,
  bnb_4bit_quant_type: nf4 | fp4, bnb_4bit_use_double_quant, bnb_4bit_quant_storage}.
- `<proj>.weight`: the [N, K] weight flattened row-major, two 4-bit codes a byte, the
  even element in the high nibble, stored [ceil(N*K/2), 1] as uint8 (or the bytes of
  another storage dtype).
- `.absmax`: max |w| of each block of `blocksize` (64) consecutive elements, fp32; with
  double quant uint8 codes of (absmax - offset) in blocks of `nested_blocksize` (256)
  of the signed 8-bit dynamic map, `.nested_absmax` fp32 per nested block and
  `.nested_quant_map` the 256-entry map; `.quant_map` the 16 code values.
- `.quant_state.bitsandbytes__<nf4|fp4>`: uint8 bytes of a JSON object with quant_type,
  blocksize, dtype, shape, nested_blocksize, nested_dtype, nested_offset.
Dequantization (bitsandbytes' dequantize_4bit): absmax = nested_quant_map[code] *
nested_absmax[block] + offset in fp32 (double quant), then w = quant_map[q] *
absmax[block] in fp32, cast to `dtype`.

When every block lies inside one row (K a multiple of the blocksize) a block is a group
of input channels: qweight holds the codes, scales the absmax [K / 64, N] (fp32, double
quant undone at load) and quant_map the table, no zeros, so the W4A16 kernel
(backend/ops/int_gemm_triton.py) reads the codes 4-bit from memory: 4.5 bits a weight
with the scales (bitsandbytes keeps ~4.13 with double quant; undoing it in the kernel
would save the rest).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from backend.models.int_types import IntFormatError, IntScheme, IntWeight, pack_along_k

QUANT_METHOD = "bitsandbytes"
# transformers' Linear4bit quantizes with bitsandbytes' default blocksize; IntLinear's
# scale shapes are fixed before the tensors are read, so checkpoints must use it.
BLOCKSIZE = 64


def bnb_scheme(quant: dict[str, Any]) -> IntScheme:
    if quant.get("load_in_8bit") or quant.get("_load_in_8bit"):
        raise IntFormatError("bitsandbytes 8-bit (LLM.int8, load_in_8bit) checkpoints are not supported; "
                             "4-bit (load_in_4bit) NF4 and FP4 are")
    if not (quant.get("load_in_4bit") or quant.get("_load_in_4bit")):
        raise IntFormatError("bitsandbytes quantization_config without load_in_4bit: true")
    quant_type = quant.get("bnb_4bit_quant_type", "fp4")          # transformers' default
    if quant_type not in ("nf4", "fp4"):
        raise IntFormatError(f"bnb_4bit_quant_type {quant_type!r}: supported are 'nf4' and 'fp4'")
    return IntScheme(QUANT_METHOD, 4, BLOCKSIZE, True)


def pop_quant_state(t: dict[str, torch.Tensor], name: str) -> dict[str, Any]:
    """`<name>.weight`'s quant state (its tensors popped from t), the packed JSON unpacked."""
    prefix = f"{name}.weight.quant_state.bitsandbytes__"
    keys = [k for k in t if k.startswith(prefix)]
    if len(keys) != 1:
        raise IntFormatError(f"{name}.weight has no bitsandbytes 4-bit quant state ({prefix}nf4|fp4); "
                             "projections kept in 16 bits (llm_int8_skip_modules) are not supported")
    qs: dict[str, Any] = json.loads(bytes(t.pop(keys[0]).tolist()).decode("utf-8"))
    qs.setdefault("quant_type", keys[0][len(prefix):])
    for field in ("absmax", "quant_map", "nested_absmax", "nested_quant_map"):
        value = t.pop(f"{name}.weight.{field}", None)
        if value is not None:
            qs[field] = value
    for field in ("absmax", "quant_map", "shape", "blocksize"):
        if qs.get(field) is None:
            raise IntFormatError(f"{name}.weight's bitsandbytes quant state lacks '{field}'")
    return qs


def dequantize_absmax(qs: dict[str, Any]) -> torch.Tensor:
    """Each block's absmax in fp32, double quant undone as bitsandbytes does."""
    if "nested_absmax" not in qs:
        return qs["absmax"].float()
    codes = qs["absmax"].reshape(-1).long()
    block = torch.arange(codes.numel()) // int(qs["nested_blocksize"])
    absmax = qs["nested_quant_map"].float()[codes] * qs["nested_absmax"].float()[block]
    return absmax + torch.tensor(float(qs["nested_offset"]), dtype=torch.float32)


def unpack_codes(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The 4-bit codes (int64) of the first `numel` elements, high nibble first."""
    b = packed.contiguous().view(torch.uint8).reshape(-1).long()
    return torch.stack([b >> 4, b & 0xF], dim=1).reshape(-1)[:numel]


def dequantize_4bit(packed: torch.Tensor, qs: dict[str, Any]) -> torch.Tensor:
    """The reference: the weight [*shape] in the quant state's dtype."""
    shape = [int(s) for s in qs["shape"]]
    numel = 1
    for s in shape:
        numel *= s
    absmax = dequantize_absmax(qs)
    block = torch.arange(numel) // int(qs["blocksize"])
    w = qs["quant_map"].float()[unpack_codes(packed, numel)] * absmax[block]
    return w.to(getattr(torch, qs.get("dtype") or "float32")).reshape(shape)


def read_projection(t: dict[str, torch.Tensor], name: str, scheme: IntScheme) -> IntWeight:
    """One 4-bit projection (popped from t) in the INT layout, codes kept 4-bit."""
    qs = pop_quant_state(t, name)
    packed = t.pop(f"{name}.weight")
    N, K = (int(s) for s in qs["shape"])
    bs = int(qs["blocksize"])
    if bs != scheme.group_size or K % bs:
        raise IntFormatError(f"{name}.weight: bitsandbytes blocksize {bs} over {K} input channels; supported is "
                             f"blocksize {scheme.group_size} dividing the input size")
    if qs["quant_map"].numel() != 16:
        raise IntFormatError(f"{name}.weight.quant_map has {qs['quant_map'].numel()} entries, not 16")
    q = unpack_codes(packed, N * K).view(N, K)
    scales = dequantize_absmax(qs).view(N, K // bs).t().contiguous()              # [G, N]
    return IntWeight(pack_along_k(q.t(), 4), scales, None, torch.arange(K, dtype=torch.int32) // bs,
                     t.pop(f"{name}.bias", None), quant_map=qs["quant_map"].float())
