"""A decoder with a vision tower beside it: what the runner calls on every
vision-language model (backend/engine/runner/mm_step.py). `encode_images` turns the
images the scheduler names into their token rows; the forward takes the step's rows
(`mm_embeds`: packed token indices and rows) in place of those tokens' embeddings.
Models with M-RoPE (Qwen2-VL) also take the step's [3, T] positions."""

from __future__ import annotations

from typing import Optional

import torch

from backend.attention.metadata import AttentionMetadata, KVCacheLayer
from backend.models.llama import CausalLM


# The llava-hf layout (LLaVA, Gemma 3): `language_model.model.*`, `vision_tower.vision_model.*`,
# `multi_modal_projector.*`, and transformers 5's `model.language_model.*` / `model.vision_tower.*`.
LLAVA_LAYOUT = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                ("model.language_model.", "model."), ("model.vision_tower.", "vision_tower."),
                ("model.multi_modal_projector.", "multi_modal_projector."),
                ("vision_tower.vision_model.", "vision_tower."))


class VisionLanguageLM(CausalLM):
    # Whether the step inputs carry M-RoPE offsets and tables (runner/mrope.py).
    uses_mrope: bool = False
    # Checkpoint name prefixes -> ours (published layouts, and transformers >= 5's).
    renames: tuple[tuple[str, str], ...] = ()

    @classmethod
    def remap_names(cls, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each rename in turn over every name (one may feed the next)."""
        for old, new in cls.renames:
            for name in [n for n in state if n.startswith(old)]:
                state[new + name[len(old):]] = state.pop(name)
        return state

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Each image's token rows [n_i, hidden], in order."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCacheLayer],
                meta: AttentionMetadata, mm_embeds: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                mrope_positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.embed(input_ids)
        if mm_embeds is not None:
            x = x.index_copy(0, mm_embeds[0], mm_embeds[1].to(x.dtype))
        return self.decode(x, input_ids, positions, kv_caches, meta, mrope_positions)

    def decode(self, x: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
               kv_caches: list[KVCacheLayer], meta: AttentionMetadata,
               mrope_positions: Optional[torch.Tensor]) -> torch.Tensor:
        return CausalLM.forward(self, input_ids, positions, kv_caches, meta, inputs_embeds=x)
