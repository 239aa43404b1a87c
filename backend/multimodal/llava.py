"""LLaVA's images: a fixed resolution (the CLIP image processor resizes and crops to the
tower's image_size), so every image is (image_size / patch_size)^2 tokens, one more with
vision_feature_select_strategy "full" (the class token kept); ordinary positions."""

from __future__ import annotations

from typing import Any

from backend.multimodal.processor import PlaceholderProcessor


class LlavaProcessor(PlaceholderProcessor):
    def __init__(self, model_path: str, hf_config: dict[str, Any]) -> None:
        super().__init__(model_path, int(hf_config.get("image_token_index", hf_config.get("image_token_id", 32000))))
        vision = hf_config["vision_config"]
        self.side = int(vision.get("image_size", 336)) // int(vision.get("patch_size", 14))
        self.extra = 1 if hf_config.get("vision_feature_select_strategy", "default") == "full" else 0

    def split(self, processed, num_images):
        pixels = processed["pixel_values"]
        return [(pixels[i:i + 1], (1, self.side, self.side)) for i in range(num_images)]

    def num_tokens(self, grid):
        return grid[1] * grid[2] + self.extra

    def max_tokens_per_image(self) -> int:
        return self.side * self.side + self.extra
