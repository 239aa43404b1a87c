"""Qwen2-VL's and Qwen2.5-VL's images: dynamic resolution (the image processor picks a
grid of 14-pixel patches), each `<|image_pad|>` placeholder expanded to the image's
merged patch count, and the M-RoPE positions of the prompt, as transformers'
Qwen2VLModel.get_rope_index computes them (a text token advances all three positions
by one; an image spans a (time, row, column) grid starting at the current position and
then advances it by its larger side)."""

from __future__ import annotations

from typing import Any

import numpy as np

from backend.multimodal.inputs import ImageItem
from backend.multimodal.processor import PlaceholderProcessor


class Qwen2VLProcessor(PlaceholderProcessor):
    placeholder_name = "<|image_pad|>"

    def __init__(self, model_path: str, hf_config: dict[str, Any]) -> None:
        super().__init__(model_path, int(hf_config.get("image_token_id", 151655)))
        self.merge = int(hf_config["vision_config"].get("spatial_merge_size", 2))

    def split(self, processed, num_images):
        grids = [tuple(int(x) for x in g) for g in processed["image_grid_thw"].tolist()]
        out, first = [], 0
        for grid in grids:
            patches = grid[0] * grid[1] * grid[2]
            out.append((processed["pixel_values"][first:first + patches], grid))
            first += patches
        return out

    def num_tokens(self, grid):
        return grid[0] * grid[1] * grid[2] // (self.merge * self.merge)

    def positions(self, num_tokens: int, items: list[ImageItem]):
        pos = np.empty((3, num_tokens), dtype=np.int64)
        current, i = 0, 0
        for item in items:
            n = item.offset - i
            pos[:, i:item.offset] = np.arange(n) + current
            current += n
            t, h, w = item.grid_thw
            gt, gh, gw = np.meshgrid(np.arange(t), np.arange(h // self.merge), np.arange(w // self.merge),
                                     indexing="ij")
            pos[:, item.offset:item.end] = np.stack([gt.ravel(), gh.ravel(), gw.ravel()]) + current
            current += max(h, w) // self.merge
            i = item.end
        pos[:, i:] = np.arange(num_tokens - i) + current
        return pos, int(pos.max()) + 1 - num_tokens

    def max_tokens_per_image(self) -> int:
        """The image processor's max_pixels over the pixels of one merged token."""
        ip = self.image_processor
        size = getattr(ip, "size", None) or {}
        max_pixels = size.get("longest_edge") or getattr(ip, "max_pixels", None) or 28 * 28 * 1280
        side = getattr(ip, "patch_size", 14) * self.merge
        return int(max_pixels) // (side * side)
