"""Weight-only INT4/INT8 checkpoints as they are found in the wild, read into one layout.

Detected from config.json's `quantization_config`:
- compressed-tensors (llmcompressor's format, what vLLM loads), `pack-quantized`:
  `weight_packed` int32 [N, K*bits/32] packed along K, values stored + 2^(bits-1);
  `weight_scale` [N, K/g]; asymmetric: `weight_zero_point` packed along N (same offset).
  w = (q - zp) * scale. Strategies group and channel.
- GPTQ: `qweight` int32 [K*bits/32, N] packed along K; `qzeros` int32 [G, N*bits/32]
  packed along N, stored minus one (GPTQ v1); `scales` [G, N]; `g_idx` [K] (act order).
  w[k] = scales[g_idx[k]] * (q[k] - (z[g_idx[k]] + 1)).
- AWQ (GEMM): `qweight` int32 [K, N*bits/32] packed along N in the order 0 2 4 6 1 3 5 7;
  `qzeros` the same; `scales` [G, N]. w = (q - z) * s.
- bitsandbytes NF4/FP4 (backend/models/bnb_format.py): codes index a 16-value table,
  w = quant_map[q] * absmax of the 64-element block: no zeros, quant_map kept.

The one layout (`IntWeight`, what backend/models/int_linear.py and its kernel read):
qweight int32 [K*bits/32, N] packed along K LSB first, scales [G, N], zeros [G, N] as
floats in the unsigned domain, g_idx [K] int32 (group of each input row). q/k/v and
gate/up concatenate along N, as the fused projections want; each keeps its own g_idx row
(act-order permutations of parts need not agree), so g_idx is [parts, K].
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from backend.models import bnb_format
from backend.models.int_types import IntFormatError, IntScheme, IntWeight, pack_along_k

METHODS = ("compressed-tensors", "gptq", "awq", "bitsandbytes")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)           # nibble i of a word holds column AWQ_ORDER[i]


def scheme_of(quant: dict[str, Any]) -> Optional[IntScheme]:
    """The checkpoint's weight-only integer scheme; None if it is not one; an error
    naming the field when it is one we do not run."""
    method = quant.get("quant_method")
    if method not in METHODS:
        return None
    if method == "bitsandbytes":
        return bnb_format.bnb_scheme(quant)
    if method == "compressed-tensors":
        groups = list((quant.get("config_groups") or {}).values())
        fmt = quant.get("format") or (groups[0].get("format") if groups else None)
        if fmt != "pack-quantized":         # another format's (int-quantized: W8A8, backend/models/w8a8.py)
            return None
        if len(groups) != 1:
            raise IntFormatError(f"compressed-tensors pack-quantized with {len(groups)} config groups: supported is "
                                 "one (W4A16/W8A16)")
        w, act = groups[0].get("weights") or {}, groups[0].get("input_activations")
        if act is not None or w.get("type") != "int" or w.get("strategy") not in ("group", "channel"):
            raise IntFormatError("compressed-tensors: only weight-only int schemes (strategy group or channel, no "
                                 "input_activations) are supported")
        scheme = IntScheme(method, int(w["num_bits"]), int(w.get("group_size") or -1)
                           if w["strategy"] == "group" else -1, bool(w.get("symmetric", True)))
    elif method == "gptq":
        if quant.get("checkpoint_format", "gptq") != "gptq":
            raise IntFormatError(f"GPTQ checkpoint_format {quant.get('checkpoint_format')!r}: supported is 'gptq'")
        scheme = IntScheme(method, int(quant.get("bits", 4)), int(quant.get("group_size", 128)),
                           bool(quant.get("sym", True)))
    else:
        if str(quant.get("version", "gemm")).lower() != "gemm":
            raise IntFormatError(f"AWQ version {quant.get('version')!r}: supported is 'gemm'")
        scheme = IntScheme(method, int(quant.get("bits", quant.get("w_bit", 4))),
                           int(quant.get("group_size", quant.get("q_group_size", 128))),
                           not quant.get("zero_point", True))
    if scheme.bits not in (4, 8) or (method == "awq" and scheme.bits != 4):
        raise IntFormatError(f"{method}: {scheme.bits}-bit weights are not supported (4 or 8; AWQ 4)")
    return scheme


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> unsigned values, the first value in the low bits, along `dim`."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    if dim == 0:
        vals = (packed.unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)
        return vals.reshape(packed.shape[0] * per, packed.shape[1])
    vals = (packed.unsqueeze(2) >> shifts.view(1, 1, per)) & ((1 << bits) - 1)
    return vals.reshape(packed.shape[0], packed.shape[1] * per)


def _groups(K: int, scheme: IntScheme) -> torch.Tensor:
    g = K if scheme.group_size == -1 else scheme.group_size
    return (torch.arange(K) // g).to(torch.int32)


def read_projection(t: dict[str, torch.Tensor], name: str, scheme: IntScheme) -> IntWeight:
    """One projection's tensors (popped from `t`) in the one layout."""
    if scheme.lookup:
        return bnb_format.read_projection(t, name, scheme)
    bits, half = scheme.bits, float(1 << (scheme.bits - 1))
    bias = t.pop(f"{name}.bias", None)
    if scheme.method == "compressed-tensors":
        packed = t.pop(f"{name}.weight_packed")
        N, K = (int(x) for x in t.pop(f"{name}.weight_shape"))
        q = unpack(packed, bits, dim=1)[:, :K]                              # [N, K] unsigned
        scales = t.pop(f"{name}.weight_scale").t().contiguous()             # [G, N]
        zp = t.pop(f"{name}.weight_zero_point", None)
        zeros = (torch.full_like(scales, half, dtype=torch.float32) if zp is None
                 else unpack(zp, bits, dim=0)[:N].t().float())              # packed along N, + offset as q
        return IntWeight(pack_along_k(q.t(), bits), scales, zeros.contiguous(), _groups(K, scheme), bias)
    if scheme.method == "gptq":
        qweight = t.pop(f"{name}.qweight")
        scales = t.pop(f"{name}.scales")
        N = scales.shape[1]
        z = unpack(t.pop(f"{name}.qzeros"), bits, dim=1)[:, :N]
        zeros = ((z + 1) & ((1 << bits) - 1)).float()                       # v1 stores zero - 1
        K = qweight.shape[0] * scheme.pack
        g_idx = t.pop(f"{name}.g_idx", None)
        g_idx = _groups(K, scheme) if g_idx is None else g_idx.to(torch.int32)
        return IntWeight(qweight.contiguous(), scales, zeros, g_idx, bias)
    # AWQ: packed along N in AWQ_ORDER
    qweight, qzeros, scales = t.pop(f"{name}.qweight"), t.pop(f"{name}.qzeros"), t.pop(f"{name}.scales")
    order = torch.tensor([AWQ_ORDER.index(c) for c in range(8)])
    cols = (torch.arange(qweight.shape[1] * 8).view(-1, 8)[:, order]).reshape(-1)

    def columns(packed):
        return unpack(packed, bits, dim=1)[:, cols]
    q = columns(qweight)                                                    # [K, N]
    return IntWeight(pack_along_k(q, bits), scales, columns(qzeros).float(), _groups(q.shape[0], scheme), bias)


def concat(parts: list[IntWeight]) -> IntWeight:
    """q/k/v or gate/up as one projection (along N); g_idx [parts, K], a row per part."""
    bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
    G = max(p.scales.shape[0] for p in parts)
    if any(p.scales.shape[0] != G for p in parts):
        raise IntFormatError("fused projections (q/k/v or gate/up) have different numbers of groups")
    lut = parts[0].quant_map
    if any((p.quant_map is None) != (lut is None) or (lut is not None and not torch.equal(p.quant_map, lut))
           for p in parts):
        raise IntFormatError("fused projections (q/k/v or gate/up) have different quant_maps (NF4 vs FP4)")
    return IntWeight(torch.cat([p.qweight for p in parts], 1), torch.cat([p.scales for p in parts], 1),
                     None if lut is not None else torch.cat([p.zeros for p in parts], 1),
                     torch.stack([p.g_idx for p in parts]), bias, lut)


def part_bounds(part_sizes: list[int]) -> list[tuple[int, int]]:
    starts = [sum(part_sizes[:i]) for i in range(len(part_sizes))]
    return [(s, s + n) for s, n in zip(starts, part_sizes)]


def dequantize(w: IntWeight, bits: int, part_sizes: Optional[list[int]] = None) -> torch.Tensor:
    """[N, K] float32: (q - zero) * scale of each input row's group (the torch reference);
    with a quant_map, q is the code's value."""
    q = unpack(w.qweight, bits, dim=0)                                      # [K, N]
    q = q.float() if w.quant_map is None else w.quant_map.float()[q.long()]
    g_idx = w.g_idx if w.g_idx.dim() == 2 else w.g_idx[None]
    bounds = part_bounds(part_sizes) if part_sizes else [(0, q.shape[1])]
    cols = []
    for (a, b), g in zip(bounds, g_idx.long()):
        qa = q[:, a:b] if w.zeros is None else q[:, a:b] - w.zeros[g, a:b]
        cols.append(qa * w.scales.float()[g, a:b])
    return torch.cat(cols, 1).t().contiguous()
