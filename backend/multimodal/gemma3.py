"""Gemma 3's images: a fixed resolution (the image processor resizes to the tower's
image_size), `mm_tokens_per_image` soft tokens each, placed as transformers'
Gemma3Processor places them: every `<start_of_image>` in the prompt becomes
"\\n\\n<start_of_image>" + soft tokens + "<end_of_image>\\n\\n". A text prompt is expanded
before tokenizing, as there (the newlines may merge with the text around them); token
ids are expanded with the tokenizer's ids of "\\n\\n". An image's soft tokens attend to
each other in both directions, so each image is computed in one step (`whole_images`)."""

from __future__ import annotations

import os
from typing import Any, Optional

from backend.engine.errors import InvalidRequestError
from backend.models.loader import TOKENIZER_FILES
from backend.multimodal.processor import PlaceholderProcessor


class Gemma3Processor(PlaceholderProcessor):
    placeholder_name = "<start_of_image>"
    whole_images = True

    def __init__(self, model_path: str, hf_config: dict[str, Any]) -> None:
        super().__init__(model_path, int(hf_config.get("image_token_index", hf_config.get("image_token_id", 262144))))
        self.boi = int(hf_config.get("boi_token_index", 255999))
        self.eoi = int(hf_config.get("eoi_token_index", 256000))
        self.per_image = int(hf_config.get("mm_tokens_per_image", 256))
        vision = hf_config["vision_config"]
        self.side = int(vision.get("image_size", 896)) // int(vision.get("patch_size", 14))
        self._tokenizer: Optional[object] = None
        self._newlines: Optional[list[int]] = None

    def _tokens(self):
        if self._tokenizer is None and any(os.path.isfile(os.path.join(self.model_path, f)) for f in TOKENIZER_FILES):
            from transformers import AutoTokenizer
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._tokenizer

    def newline_ids(self) -> list[int]:
        """The ids of "\\n\\n" around an image ([] for a checkpoint without a tokenizer)."""
        if self._newlines is None:
            tok = self._tokens()
            self._newlines = tok.encode("\n\n", add_special_tokens=False) if tok is not None else []
        return self._newlines

    def expand_text(self, text: str) -> str:
        tok = self._tokens()
        if tok is None:
            return text
        boi, soft, eoi = tok.convert_ids_to_tokens([self.boi, self.image_token_id, self.eoi])
        return text.replace(boi, f"\n\n{boi}{soft * self.per_image}{eoi}\n\n")

    def count_placeholders(self, token_ids: list[int]) -> int:
        if self.image_token_id in token_ids:            # expanded already (a text prompt)
            return sum(1 for i, t in enumerate(token_ids)
                       if t == self.image_token_id and (i == 0 or token_ids[i - 1] != self.image_token_id))
        return sum(1 for t in token_ids if t == self.boi)

    def place(self, token_ids: list[int], lengths: list[int]) -> tuple[list[int], list[int]]:
        if self.image_token_id in token_ids:
            starts = [i for i, t in enumerate(token_ids)
                      if t == self.image_token_id and (i == 0 or token_ids[i - 1] != self.image_token_id)]
            for start in starts:        # each run as the processor writes it, or the request is wrong
                end = start + self.per_image
                if (start == 0 or token_ids[start - 1] != self.boi or end >= len(token_ids)
                        or token_ids[start:end] != [self.image_token_id] * self.per_image
                        or token_ids[end] != self.eoi):
                    raise InvalidRequestError(
                        f"the prompt's image tokens (id {self.image_token_id}) are not each <start_of_image>, "
                        f"{self.per_image} of them and <end_of_image>: put one <start_of_image> where each "
                        "image goes and let the engine expand it")
            return list(token_ids), starts
        ids: list[int] = []
        offsets: list[int] = []
        nl = self.newline_ids()
        for t in token_ids:
            if t == self.boi:
                ids += nl + [self.boi]
                offsets.append(len(ids))
                ids += [self.image_token_id] * self.per_image + [self.eoi] + nl
            else:
                ids.append(t)
        return ids, offsets

    def split(self, processed, num_images):
        pixels = processed["pixel_values"]
        return [(pixels[i:i + 1], (1, self.side, self.side)) for i in range(num_images)]

    def num_tokens(self, grid):
        return self.per_image

    def max_tokens_per_image(self) -> int:
        return self.per_image
