"""Gemma 3 with images (`Gemma3ForConditionalGeneration`): a SigLIP vision tower, the
multimodal projector (the patch grid average-pooled to `mm_tokens_per_image`, Gemma's
RMSNorm, a projection), and the Gemma 3 decoder (gemma.py, paged). An image's tokens
attend to each other in both directions (the attention's key limits,
backend/engine/runner/image_attention.py). As transformers' SiglipVisionModel and
Gemma3Model compute it, operation for operation."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backend.models.config import ModelConfig
from backend.models.gemma import GemmaCausalLM
from backend.models.llava import ClipLayer
from backend.models.vision_lm import LLAVA_LAYOUT, VisionLanguageLM
from backend.parallel.group import SINGLE

_TOWER = ("vision_tower.", "multi_modal_projector.")


class SiglipVisionTower(nn.Module):
    """`vision_tower.*`: patch embedding (with a bias) plus learned positions, no class
    token, the layers (CLIP's), then `post_layernorm`."""

    def __init__(self, vc: dict[str, Any]) -> None:
        super().__init__()
        dim, patch = vc["hidden_size"], vc.get("patch_size", 14)
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Conv2d(vc.get("num_channels", 3), dim, patch, patch)
        self.embeddings.position_embedding = nn.Embedding((vc.get("image_size", 224) // patch) ** 2, dim)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(ClipLayer({"hidden_act": "gelu_pytorch_tanh", **vc})
                                            for _ in range(vc["num_hidden_layers"]))
        self.post_layernorm = nn.LayerNorm(dim, eps=vc.get("layer_norm_eps", 1e-6))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        emb = self.embeddings
        w = emb.patch_embedding.weight
        x = emb.patch_embedding(pixel_values.to(w.dtype)).flatten(2).transpose(1, 2)
        x = x + emb.position_embedding.weight[None]
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Gemma3Projector(nn.Module):
    def __init__(self, hf: dict[str, Any], text_hidden: int) -> None:
        super().__init__()
        vc = hf["vision_config"]
        dim = vc["hidden_size"]
        self.mm_input_projection_weight = nn.Parameter(torch.empty(dim, text_hidden))
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.empty(dim))
        self.eps = vc.get("layer_norm_eps", 1e-6)
        self.side = vc.get("image_size", 896) // vc.get("patch_size", 14)
        self.kernel = self.side // int(hf.get("mm_tokens_per_image", 256) ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, d = x.shape
        grid = x.transpose(1, 2).reshape(b, d, self.side, self.side).contiguous()
        pooled = F.avg_pool2d(grid, kernel_size=self.kernel, stride=self.kernel).flatten(2).transpose(1, 2)
        # Gemma's RMSNorm, in fp32: x * rsqrt(mean(x^2) + eps) * (1 + w).
        xf = pooled.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = (normed * (1.0 + self.mm_soft_emb_norm.weight.float())).type_as(pooled)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(x)


class Gemma3VLCausalLM(VisionLanguageLM, GemmaCausalLM):
    renames = LLAVA_LAYOUT

    def __init__(self, cfg: ModelConfig, attn_factory, max_position=None, ops=None, tp=SINGLE) -> None:
        super().__init__(cfg, attn_factory, max_position, ops, tp)
        self.vision_tower = SiglipVisionTower(cfg.hf_config["vision_config"])
        self.multi_modal_projector = Gemma3Projector(cfg.hf_config, cfg.hidden_size)

    @staticmethod
    def adapt_checkpoint(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Gemma's (1 + w) norms folded for the decoder only: the tower's LayerNorms are
        plain, and the projector's norm applies its (1 + w) itself."""
        tower = {k: state.pop(k) for k in list(state) if k.startswith(_TOWER)}
        state = GemmaCausalLM.adapt_checkpoint(cfg, state)
        state.update(tower)
        return state

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        return list(self.multi_modal_projector(self.vision_tower(pixel_values)))
