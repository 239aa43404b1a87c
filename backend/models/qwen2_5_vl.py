"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): Qwen2-VL's decoder, M-RoPE and
image processing (qwen2_vl.py) with another vision tower: RMSNorm, a gated MLP, and
window attention. Patches are regrouped by windows of `window_size` pixels (in units
of merged 2x2 groups); most blocks attend within a window, the blocks of
`fullatt_block_indexes` within the whole image; the merged tokens go back to the
image's order at the end. As transformers computes it (vision_utils'
get_vision_window_index), written here on plain lists."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from backend.models.llama import RMSNorm
from backend.models.qwen2_vl import PatchMerger, Qwen2VLCausalLM, VisionAttention, VisionTower, image_bounds


class TowerRMSNorm(RMSNorm):
    """RMSNorm applied here (the decoder's are fused into LayerOps), as transformers'."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__(dim, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class GatedMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class WindowBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, full: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = TowerRMSNorm(dim), TowerRMSNorm(dim)
        self.attn = VisionAttention(dim, heads)
        self.mlp = GatedMLP(dim, hidden)
        self.full = full            # attends within the image, not its window

    def forward(self, x: torch.Tensor, cu: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu, cos, sin)
        return x + self.mlp(self.norm2(x))


class WindowVisionTower(VisionTower):
    def __init__(self, vc: dict[str, Any]) -> None:
        self.window_size = int(vc.get("window_size", 112))
        super().__init__(vc)

    @staticmethod
    def width(vc: dict[str, Any]) -> int:
        return vc["hidden_size"]

    def make_block(self, vc: dict[str, Any], index: int) -> nn.Module:
        full = index in set(vc.get("fullatt_block_indexes", (7, 15, 23, 31)))
        return WindowBlock(self.dim, vc["num_heads"], vc.get("intermediate_size", 3420), full)

    def make_merger(self, vc: dict[str, Any]) -> nn.Module:
        return PatchMerger(vc.get("out_hidden_size", vc["hidden_size"]), self.dim, self.merge, norm=TowerRMSNorm)

    def windows(self, grid_thw: list[tuple[int, int, int]]) -> tuple[list[int], list[int]]:
        """(merged groups in window order, window bounds in patches)."""
        side = self.window_size // self.merge // self.patch        # merged groups per window side
        unit = self.merge * self.merge
        order: list[int] = []
        bounds = [0]
        base = 0
        for t, h, w in grid_thw:
            gh, gw = h // self.merge, w // self.merge
            for f in range(t):
                for wy in range(0, gh, side):
                    for wx in range(0, gw, side):
                        group = [base + (f * gh + y) * gw + x for y in range(wy, min(wy + side, gh))
                                 for x in range(wx, min(wx + side, gw))]
                        order += group
                        bounds.append(bounds[-1] + len(group) * unit)
            base += t * gh * gw
        return order, bounds

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        w = self.patch_embed.proj.weight
        x = pixel_values.to(w.dtype).view(-1, self.in_channels, self.temporal, self.patch, self.patch)
        x = self.patch_embed.proj(x).view(-1, self.dim)
        cos, sin = self.rotary(grid_thw, x.device)
        order, window_bounds = self.windows(grid_thw)
        index = torch.tensor(order, device=x.device)
        unit = self.merge * self.merge

        def regroup(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(-1, unit, t.shape[-1])[index].reshape(-1, t.shape[-1])
        x, cos, sin = regroup(x), regroup(cos), regroup(sin)
        image = image_bounds(grid_thw)
        for block in self.blocks:
            x = block(x, image if block.full else window_bounds, cos, sin)
        merged = self.merger(x)
        return merged[torch.argsort(index)]


class Qwen2_5_VLCausalLM(Qwen2VLCausalLM):
    tower_class = WindowVisionTower
