"""LLaVA (`LlavaForConditionalGeneration`, LLaVA-1.5's layout): a CLIP vision tower, a
two-layer projector, and the Llama decoder (ours, paged). An image is the tower's hidden
states after `vision_feature_layer` (an index into the states before the first layer and
after each; a list concatenates several), without the class token under
`vision_feature_select_strategy` "default", projected to the decoder's width: one row per
patch. As transformers' CLIPVisionModel and LlavaModel compute it, operation for
operation (greedy output matches in fp32)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backend.models.config import ModelConfig
from backend.models.vision_lm import LLAVA_LAYOUT, VisionLanguageLM
from backend.parallel.group import SINGLE

_ACTS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu,
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class ClipAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = (p(x).view(b, n, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))


class ClipLayer(nn.Module):
    def __init__(self, vc: dict[str, Any]) -> None:
        super().__init__()
        dim, eps = vc["hidden_size"], vc.get("layer_norm_eps", 1e-5)
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)
        self.self_attn = ClipAttention(dim, vc["num_attention_heads"])
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(dim, vc["intermediate_size"]), nn.Linear(vc["intermediate_size"], dim)
        self.act = _ACTS[vc.get("hidden_act", "quick_gelu")]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.layer_norm2(x))))


class ClipVisionTower(nn.Module):
    """`vision_tower.*`: embeddings (class token, patches, learned positions), a
    LayerNorm before the layers (CLIP's `pre_layrnorm`), the layers."""

    def __init__(self, vc: dict[str, Any]) -> None:
        super().__init__()
        dim, patch = vc["hidden_size"], vc.get("patch_size", 14)
        self.embeddings = nn.Module()
        self.embeddings.class_embedding = nn.Parameter(torch.empty(dim))
        self.embeddings.patch_embedding = nn.Conv2d(vc.get("num_channels", 3), dim, patch, patch, bias=False)
        positions = (vc.get("image_size", 336) // patch) ** 2 + 1
        self.embeddings.position_embedding = nn.Embedding(positions, dim)
        eps = vc.get("layer_norm_eps", 1e-5)
        self.pre_layrnorm = nn.LayerNorm(dim, eps=eps)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(ClipLayer(vc) for _ in range(vc["num_hidden_layers"]))
        self.post_layernorm = nn.LayerNorm(dim, eps=eps)       # (the pooled output's: unused here)

    def hidden_states(self, pixel_values: torch.Tensor, last: int) -> list[torch.Tensor]:
        """The states before the first layer and after each of the first `last` layers."""
        emb = self.embeddings
        w = emb.patch_embedding.weight
        patches = emb.patch_embedding(pixel_values.to(w.dtype)).flatten(2).transpose(1, 2)
        x = torch.cat([emb.class_embedding.expand(patches.shape[0], 1, -1), patches], dim=1)
        x = self.pre_layrnorm(x + emb.position_embedding.weight[None])
        states = [x]
        for layer in self.encoder.layers[:last]:
            x = layer(x)
            states.append(x)
        return states


class LlavaCausalLM(VisionLanguageLM):
    renames = LLAVA_LAYOUT

    def __init__(self, cfg: ModelConfig, attn_factory, max_position=None, ops=None, tp=SINGLE) -> None:
        super().__init__(cfg, attn_factory, max_position, ops, tp)
        hf = cfg.hf_config
        vc = hf["vision_config"]
        depth = vc["num_hidden_layers"]
        layers = hf.get("vision_feature_layer", -2)
        self.feature_layers = [i % (depth + 1) for i in (layers if isinstance(layers, list) else [layers])]
        self.drop_class_token = hf.get("vision_feature_select_strategy", "default") == "default"
        self.vision_tower = ClipVisionTower(vc)
        bias = hf.get("multimodal_projector_bias", True)
        self.multi_modal_projector = nn.Module()
        self.multi_modal_projector.linear_1 = nn.Linear(vc["hidden_size"] * len(self.feature_layers),
                                                        cfg.hidden_size, bias=bias)
        self.multi_modal_projector.linear_2 = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=bias)
        self.projector_act = _ACTS[hf.get("projector_hidden_act", "gelu")]

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        states = self.vision_tower.hidden_states(pixel_values, max(self.feature_layers))
        features = torch.cat([states[i][:, 1:] if self.drop_class_token else states[i]
                              for i in self.feature_layers], dim=-1)
        p = self.multi_modal_projector
        return list(p.linear_2(self.projector_act(p.linear_1(features))))
