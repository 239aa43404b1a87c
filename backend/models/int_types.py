"""What every integer weight format shares (GPTQ, AWQ, compressed-tensors in
int_formats.py, bitsandbytes in bnb_format.py): the scheme, the one in-memory layout,
the error that names a field, and packing along K."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


class IntFormatError(ValueError):
    pass


@dataclass(frozen=True)
class IntScheme:
    method: str
    bits: int
    group_size: int                             # -1: one group per row (channel)
    symmetric: bool

    @property
    def pack(self) -> int:
        return 32 // self.bits

    @property
    def lookup(self) -> bool:
        """Codes index a table of values (bitsandbytes NF4/FP4) instead of being integers."""
        return self.method == "bitsandbytes"


@dataclass
class IntWeight:
    qweight: torch.Tensor       # int32 [K / pack, N]
    scales: torch.Tensor        # [G, N]
    zeros: Optional[torch.Tensor]   # float32 [G, N], unsigned domain; None with a quant_map
    g_idx: torch.Tensor         # int32 [K], or [parts, K] once fused (concat)
    bias: Optional[torch.Tensor] = None
    # bitsandbytes NF4/FP4: fp32 [16], the value of each code (w = quant_map[q] * scale).
    quant_map: Optional[torch.Tensor] = None


def pack_along_k(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values [K, N] -> int32 [K / pack, N], the first row in the low bits."""
    per = 32 // bits
    K, N = q.shape
    shifts = torch.arange(per, dtype=torch.int64, device=q.device) * bits
    q = q.to(torch.int64).view(K // per, per, N) << shifts.view(1, per, 1)
    return q.sum(dim=1).to(torch.int32)            # no overlapping bits: the sum is the bitwise or
