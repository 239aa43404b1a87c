"""Qwen2-VL's images: the checkpoint's image processor (transformers', from its
preprocessor_config.json), each `<|image_pad|>` placeholder expanded to the image's
merged patch count, and the M-RoPE positions of the prompt, as transformers'
Qwen2VLModel.get_rope_index computes them (a text token advances all three positions
by one; an image spans a (time, row, column) grid starting at the current position and
then advances it by its larger side)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from backend.engine.errors import InvalidRequestError
from backend.multimodal.inputs import ImageItem, MultiModalInputs


class Qwen2VLProcessor:
    def __init__(self, model_path: str, hf_config: dict[str, Any]) -> None:
        self.model_path = model_path
        self.image_token_id = int(hf_config.get("image_token_id", 151655))
        self.merge = int(hf_config["vision_config"].get("spatial_merge_size", 2))
        self._image_processor = None

    @property
    def image_processor(self):
        if self._image_processor is None:
            from transformers import AutoImageProcessor
            self._image_processor = AutoImageProcessor.from_pretrained(self.model_path)
        return self._image_processor

    def process(self, token_ids: list[int], images: list) -> tuple[list[int], MultiModalInputs]:
        marks = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(marks) != len(images):
            raise InvalidRequestError(
                f"the prompt has {len(marks)} image placeholder(s) (token id {self.image_token_id}, <|image_pad|>) "
                f"for {len(images)} image(s): put one where each image goes (the chat template does)")
        try:
            processed = self.image_processor(images=images, return_tensors="pt")
        except Exception as e:
            raise InvalidRequestError(f"the image processor could not read an image: {e}") from None
        pixel_values, grids = processed["pixel_values"], [tuple(int(x) for x in g)
                                                           for g in processed["image_grid_thw"].tolist()]
        ids: list[int] = []
        items: list[ImageItem] = []
        first_patch, prev = 0, 0
        for mark, grid in zip(marks, grids):
            t, h, w = grid
            patches = t * h * w
            pixels = pixel_values[first_patch:first_patch + patches]
            first_patch += patches
            length = patches // (self.merge * self.merge)
            ids += token_ids[prev:mark]
            digest = hashlib.sha256(np.asarray(grid, dtype=np.int64).tobytes())
            digest.update(pixels.contiguous().numpy().tobytes())
            items.append(ImageItem(digest.digest(), len(ids), length, pixels, grid))
            ids += [self.image_token_id] * length
            prev = mark + 1
        ids += token_ids[prev:]
        positions = self.mrope_positions(len(ids), items)
        return ids, MultiModalInputs(items, positions, int(positions.max()) + 1 - len(ids))

    def mrope_positions(self, num_tokens: int, items: list[ImageItem]) -> np.ndarray:
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
        return pos

    def max_tokens_per_image(self) -> int:
        """The most placeholder tokens the image processor makes of one image (its
        max_pixels over the pixels of one merged token)."""
        ip = self.image_processor
        size = getattr(ip, "size", None) or {}
        max_pixels = size.get("longest_edge") or getattr(ip, "max_pixels", None) or 28 * 28 * 1280
        side = getattr(ip, "patch_size", 14) * self.merge
        return int(max_pixels) // (side * side)
