"""A request's images as the engine carries them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


@dataclass(frozen=True)
class ImageItem:
    # Content hash of what the vision tower reads (pixels and grid): the encoder cache's
    # key, and part of the prefix-cache key of every block its tokens are in.
    mm_hash: bytes
    offset: int                         # index of its first placeholder token in the prompt
    length: int                         # its placeholder tokens (the tower's output rows)
    pixel_values: torch.Tensor          # the image processor's patches
    grid_thw: tuple[int, int, int]      # patches in time, rows, columns

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def hash_ids(self) -> tuple[int, ...]:
        """The whole hash as signed 64-bit ints (prefix-cache key elements)."""
        return tuple(int.from_bytes(self.mm_hash[i:i + 8], "little", signed=True)
                     for i in range(0, len(self.mm_hash), 8))


@dataclass
class MultiModalInputs:
    items: list[ImageItem]
    # M-RoPE (Qwen2-VL): each prompt token's (temporal, row, column) position [3, P],
    # and the offset of every later token's position from its index.
    mrope_positions: Optional[np.ndarray] = None
    mrope_delta: int = 0

    def block_extras(self, a: int, b: int) -> tuple[int, ...]:
        """What a prefix-cache key of prompt tokens a:b adds to their ids: (hash, start
        relative to a) of every image whose tokens overlap them, so that the same text
        with another image never matches."""
        extras: list[int] = []
        for item in self.items:
            if item.offset < b and item.end > a:
                extras += [*item.hash_ids, item.offset - a]
        return tuple(extras)

    def overlapping(self, a: int, b: int) -> list[int]:
        """Indices of the images whose placeholder tokens overlap tokens a:b."""
        return [i for i, item in enumerate(self.items) if item.offset < b and item.end > a]
