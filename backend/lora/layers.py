"""The model's projections with LoRA deltas: each wraps the base layer (plain, FP8) and
holds every slot's A and B for its slices (q/k/v of qkv_proj, gate/up of gate_up_proj).

forward = base(x), then out[:, slice] += SGMV(x, A, B) for each slice, for the rows under
an adapter: one shrink and one expand for all the slices. Rows of the base model get the
base output untouched; so does every row of a step without adapters (no kernel runs).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from backend.lora.adapter import TARGETS
from backend.lora.punica import LoRAMetadata

# The engine's fused projection -> its slices' Hugging Face names, in output order.
SLICES: dict[str, tuple[str, ...]] = {}
for _hf, (_fused, _i) in TARGETS.items():
    SLICES.setdefault(_fused, ())
    SLICES[_fused] += (_hf,)


class LoRAState:
    """What every wrapped layer reads during a forward: the step's row groups and the
    slots' scalings (set by LoRASlots)."""

    def __init__(self, num_slots: int, max_rank: int, device: torch.device, shrink: Callable,
                 expand: Callable) -> None:
        self.num_slots, self.max_rank = num_slots, max_rank
        self.meta: LoRAMetadata | None = None
        self.scaling = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.scaling_cpu = [0.0] * num_slots
        self.shrink, self.expand = shrink, expand


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, slice_sizes: list[int], in_features: int, state: LoRAState,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base = base
        self.state = state
        S, R = state.num_slots, state.max_rank
        self.slice_sizes = slice_sizes
        self.offsets = [sum(slice_sizes[:i]) for i in range(len(slice_sizes))]
        # A of every slice stacked along the rank: one shrink serves them all.
        self.lora_a = torch.zeros(S, len(slice_sizes) * R, in_features, dtype=dtype, device=device)
        # Every slice's B in one tensor, stored [N, S, R] and handed out as [S, N, R] views
        # (the whole, and one per slice): the expand takes all slices at once, and the
        # torch path's dense form reads a slice's slots as one [n, S * R] matrix without a copy.
        self.lora_b_all = torch.zeros(sum(slice_sizes), S, R, dtype=dtype, device=device).permute(1, 0, 2)
        self.lora_b = [self.lora_b_all[:, off:off + n] for off, n in zip(self.offsets, slice_sizes)]

    def set_slot(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter's (A [r, in], B [out, r]) per slice into `slot`; None: the
        adapter leaves that slice alone (zeros)."""
        R = self.state.max_rank
        self.lora_a[slot].zero_()
        for i, ab in enumerate(weights):
            self.lora_b[i][slot].zero_()
            if ab is None:
                continue
            a, b = ab
            r = a.shape[0]
            self.lora_a[slot, i * R:i * R + r].copy_(a)
            self.lora_b[i][slot, :, :r].copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        meta = self.state.meta
        if meta is None:
            return out
        y = x.new_empty(x.shape[0], self.lora_a.shape[1])
        self.state.shrink(x, self.lora_a, meta, y)
        self.state.expand(y, self.lora_b_all, meta, out, self.state.scaling, self.state.scaling_cpu, self.slice_sizes)
        return out


def wrap_model(model: nn.Module, shapes: dict[str, tuple[int, int]], state: LoRAState, dtype: torch.dtype,
               device: torch.device) -> list[dict[str, LoRALinear]]:
    """Swap every supported projection of every layer for a LoRALinear around it.
    shapes: (in, out) per Hugging Face projection. Returns, per layer, fused name -> layer."""
    wrapped = []
    for layer in model.model.layers:
        mine = {}
        for fused, parts in SLICES.items():
            parent_name, attr = fused.split(".")
            parent = getattr(layer, parent_name)
            lin = LoRALinear(getattr(parent, attr), [shapes[p][1] for p in parts], shapes[parts[0]][0], state,
                             dtype, device)
            setattr(parent, attr, lin)
            mine[fused] = lin
        wrapped.append(mine)
    return wrapped
