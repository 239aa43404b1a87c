"""What every family's multimodal processor does alike: the checkpoint's transformers
image processor (loaded once, lazily), one placeholder token per image in the prompt
expanded to the image's token count, and each image's content hash. A family says how
many tokens an image becomes, how its processed pixels split per image, and (M-RoPE)
the prompt's positions."""

from __future__ import annotations

import hashlib
from typing import Any, Optional

import numpy as np
import torch

from backend.engine.errors import InvalidRequestError
from backend.multimodal.inputs import ImageItem, MultiModalInputs


class PlaceholderProcessor:
    placeholder_name = "<image>"
    # The model's image tokens attend to the whole image (Gemma 3): each image is computed
    # in one step (scheduling/encoder_cache.py) with key limits (runner/image_attention.py).
    whole_images = False

    def __init__(self, model_path: str, image_token_id: int) -> None:
        self.model_path = model_path
        self.image_token_id = image_token_id
        self._image_processor = None

    @property
    def image_processor(self):
        if self._image_processor is None:
            from transformers import AutoImageProcessor
            self._image_processor = AutoImageProcessor.from_pretrained(self.model_path)
        return self._image_processor

    # -- what a family says
    def split(self, processed: dict[str, Any], num_images: int) -> list[tuple[torch.Tensor, tuple[int, int, int]]]:
        """Each image's pixels (what the tower reads for it) and grid (time, rows, columns
        of patches)."""
        raise NotImplementedError

    def num_tokens(self, grid: tuple[int, int, int]) -> int:
        raise NotImplementedError

    def positions(self, num_tokens: int, items: list[ImageItem]) -> tuple[Optional[np.ndarray], int]:
        """(M-RoPE positions [3, P] and delta) or (None, 0) for ordinary positions."""
        return None, 0

    def max_tokens_per_image(self) -> int:
        raise NotImplementedError

    def expand_text(self, text: str) -> str:
        """A text prompt before tokenizing (Gemma 3 expands its images there, as its
        transformers processor does, so that the text around them tokenizes the same)."""
        return text

    def count_placeholders(self, token_ids: list[int]) -> int:
        return sum(1 for t in token_ids if t == self.image_token_id)

    def place(self, token_ids: list[int], lengths: list[int]) -> tuple[list[int], list[int]]:
        """The prompt with each image's tokens in place of its placeholder, and where each
        image's tokens start."""
        ids: list[int] = []
        offsets: list[int] = []
        lengths_left = iter(lengths)
        for t in token_ids:
            if t == self.image_token_id:
                offsets.append(len(ids))
                ids += [self.image_token_id] * next(lengths_left)
            else:
                ids.append(t)
        return ids, offsets

    # -- common
    def process(self, token_ids: list[int], images: list) -> tuple[list[int], MultiModalInputs]:
        found = self.count_placeholders(token_ids)
        if found != len(images):
            raise InvalidRequestError(
                f"the prompt has {found} image placeholder(s) (token id {self.image_token_id}, "
                f"{self.placeholder_name}) for {len(images)} image(s): put one where each image goes (the chat "
                "template does)")
        try:
            processed = self.image_processor(images=images, return_tensors="pt")
        except Exception as e:
            raise InvalidRequestError(f"the image processor could not read an image: {e}") from None
        parts = self.split(processed, len(images))
        ids, offsets = self.place(token_ids, [self.num_tokens(grid) for _, grid in parts])
        items: list[ImageItem] = []
        for offset, (pixels, grid) in zip(offsets, parts):
            digest = hashlib.sha256(np.asarray(grid, dtype=np.int64).tobytes())
            digest.update(pixels.contiguous().numpy().tobytes())
            items.append(ImageItem(digest.digest(), offset, self.num_tokens(grid), pixels, grid))
        ends = [0] + [item.end for item in items]
        if any(item.offset < end for item, end in zip(items, ends)) or ends[-1] > len(ids):
            raise InvalidRequestError("the prompt's image placeholders overlap or run past its end")
        positions, delta = self.positions(len(ids), items)
        return ids, MultiModalInputs(items, positions, delta)
