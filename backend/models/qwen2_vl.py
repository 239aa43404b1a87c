"""Qwen2-VL (`Qwen2VLForConditionalGeneration`): a vision tower whose merged patches
replace the prompt's image placeholder tokens, and the Qwen2 decoder (our paged one)
with multimodal RoPE.

The vision tower follows transformers' modules operation for operation (a conv3d patch
embedding, 2-D rotary over (row, column), blocks attending within each image, a 2x2
patch merger), so that greedy output matches token for token in fp32. It runs once per
image, outside the paged decoder: the runner calls `encode_images` for the images the
scheduler names, keeps the outputs by content hash, and passes the step's rows in
(`mm_embeds`).

M-RoPE: rotary channels are split in three sections (`mrope_section`) that rotate by a
temporal, a row and a column position. A text token has all three equal, so any step
without image tokens runs the ordinary 1-D tables with the request's offset added by
the runner (decode graphs included); a step with image tokens passes
`mrope_positions` [3, T] and this model builds that step's per-token tables.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from backend.attention.metadata import AttentionMetadata, KVCacheLayer
from backend.models.config import ModelConfig
from backend.models.vision_lm import VisionLanguageLM
from backend.models.rotary import inverse_frequencies
from backend.parallel.group import SINGLE


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_VISION_ACTS = {"quick_gelu": _quick_gelu, "gelu": F.gelu, "silu": F.silu,
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        # Rotated in fp32, as transformers does (apply_rotary_pos_emb_vision).
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        qf, kf = q.float(), k.float()
        q = (qf * cos + _rotate_half(qf) * sin).to(q.dtype)
        k = (kf * cos + _rotate_half(kf) * sin).to(k.dtype)
        out = []
        for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):     # attention within each image (frame)
            qi, ki, vi = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            out.append(F.scaled_dot_product_attention(qi, ki, vi)[0].transpose(0, 1))
        return self.proj(torch.cat(out).reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_dim: int, act: str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(dim, mlp_dim)
        self.mlp.fc2 = nn.Linear(mlp_dim, dim)
        self.act = _VISION_ACTS[act]

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.norm2(x))))


class PatchMerger(nn.Module):
    """Each 2x2 group of neighbouring patches (contiguous in the processor's order) to
    one token of the decoder's width."""

    def __init__(self, out_dim: int, dim: int, merge: int, norm: type = nn.LayerNorm) -> None:
        super().__init__()
        self.width = dim * merge * merge
        self.ln_q = norm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionTower(nn.Module):
    """Qwen2-VL's tower; Qwen2.5-VL's (qwen2_5_vl.py) changes its blocks, its norms and
    which patches attend to which."""

    def __init__(self, vc: dict[str, Any]) -> None:
        super().__init__()
        dim, heads = self.width(vc), vc["num_heads"]
        self.patch, self.temporal = vc.get("patch_size", 14), vc.get("temporal_patch_size", 2)
        self.in_channels, self.dim = vc.get("in_channels", 3), dim
        self.merge = vc.get("spatial_merge_size", 2)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(self.in_channels, dim, kernel_size=(self.temporal, self.patch, self.patch),
                                          stride=(self.temporal, self.patch, self.patch), bias=False)
        self.blocks = nn.ModuleList(self.make_block(vc, i) for i in range(vc["depth"]))
        self.merger = self.make_merger(vc)
        self.theta = float((vc.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        self.head_dim = dim // heads

    @staticmethod
    def width(vc: dict[str, Any]) -> int:
        return vc["embed_dim"]

    def make_block(self, vc: dict[str, Any], index: int) -> nn.Module:
        return VisionBlock(self.dim, vc["num_heads"], int(self.dim * vc.get("mlp_ratio", 4)),
                           vc.get("hidden_act", "quick_gelu"))

    def make_merger(self, vc: dict[str, Any]) -> nn.Module:
        return PatchMerger(vc["hidden_size"], self.dim, self.merge)

    def rotary(self, grid_thw: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [patches, head_dim] from each patch's (row, column), in the
        processor's patch order (merge groups contiguous)."""
        m, rows = self.merge, []
        for t, h, w in grid_thw:
            hh, ww = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
            shape = (h // m, m, w // m, m)
            hw = torch.stack([hh.reshape(shape).transpose(1, 2).flatten(),
                              ww.reshape(shape).transpose(1, 2).flatten()], dim=-1)
            rows.append(hw.repeat(t, 1))
        pos = torch.cat(rows)
        spatial = self.head_dim // 2        # half the channels for rows, half for columns
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=device) / spatial))
        freqs = pos[..., None].float() * inv_freq        # [N, 2, head_dim / 4]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values: the image processor's flattened patches [patches, C * T * P * P];
        returns the merged tokens [patches / merge^2, decoder hidden]."""
        w = self.patch_embed.proj.weight
        x = pixel_values.to(w.dtype).view(-1, self.in_channels, self.temporal, self.patch, self.patch)
        x = self.patch_embed.proj(x).view(-1, self.dim)
        cos, sin = self.rotary(grid_thw, x.device)
        return self.merger(self.run_blocks(x, cos, sin, grid_thw))

    def run_blocks(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        cu = image_bounds(grid_thw)
        for block in self.blocks:
            x = block(x, cu, cos, sin)
        return x


def image_bounds(grid_thw: list[tuple[int, int, int]]) -> list[int]:
    """Where each image's (each frame's) patches start and end in the packed patches."""
    cu = [0]
    for t, h, w in grid_thw:
        for _ in range(t):
            cu.append(cu[-1] + h * w)
    return cu


class Qwen2VLCausalLM(VisionLanguageLM):
    """The decoder (Qwen2's, paged) with the vision tower beside it (`visual.*`)."""
    tower_class: type = VisionTower
    uses_mrope = True
    # transformers >= 5 may save these; the published checkpoints have `model.*` / `visual.*`.
    renames = (("model.language_model.", "model."), ("model.visual.", "visual."))

    def __init__(self, cfg: ModelConfig, attn_factory, max_position: Optional[int] = None, ops=None,
                 tp=SINGLE) -> None:
        super().__init__(cfg, attn_factory, max_position, ops, tp)
        self.visual = self.tower_class(cfg.hf_config["vision_config"])
        self.mrope_section = list(mrope_section(cfg.hf_config))

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Each image's tokens [n_i, hidden], in order."""
        merged = self.visual(pixel_values, grid_thw)
        sizes = [t * h * w // self.visual.merge ** 2 for t, h, w in grid_thw]
        return list(torch.split(merged, sizes))

    def _mrope_tables(self, mrope_positions: torch.Tensor) -> SimpleNamespace:
        """Per-token cos/sin [T, head_dim] for positions [3, T], as transformers builds
        them: fp32 angles per section from its own position row."""
        inv_freq = inverse_frequencies(self.config.rope_dim, self.config.rope_theta, None).to(mrope_positions.device)
        freqs = mrope_positions[..., None].float() * inv_freq             # [3, T, half]
        parts = freqs.split(self.mrope_section, dim=-1)
        freqs = torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return SimpleNamespace(cos_cache=emb.cos(), sin_cache=emb.sin())

    def decode(self, x: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
               kv_caches: list[KVCacheLayer], meta: AttentionMetadata,
               mrope_positions: Optional[torch.Tensor]) -> torch.Tensor:
        """mrope_positions: [3, T] for a step with image tokens: this step's tables."""
        if mrope_positions is None:
            return super().decode(x, input_ids, positions, kv_caches, meta, None)
        self._step_rotary = self._mrope_tables(mrope_positions)
        try:
            step_positions = torch.arange(x.shape[0], device=x.device, dtype=positions.dtype)
            return super().decode(x, input_ids, step_positions, kv_caches, meta, None)
        finally:
            self._step_rotary = None

    _step_rotary: Optional[SimpleNamespace] = None

    def rotary_for(self, layer_idx: int):
        return self._step_rotary or self.rotary


def mrope_section(hf_config: dict[str, Any]) -> tuple[int, ...]:
    """config.json's mrope_section (rope_parameters in transformers >= 5, rope_scaling
    before; top level or text_config)."""
    for cfg in (hf_config.get("text_config") or {}, hf_config):
        for key in ("rope_parameters", "rope_scaling"):
            section = (cfg.get(key) or {}).get("mrope_section")
            if section:
                return tuple(int(s) for s in section)
    raise ValueError("config.json names no mrope_section (rope_parameters.mrope_section)")
