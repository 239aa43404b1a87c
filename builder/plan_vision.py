"""A vision-language build's share of the memory plan: the vision tower's weights (part
of the checkpoint's files, read from their headers) and the encoder cache the engine
keeps (encoder_cache_size output rows of the decoder's width), which comes out of the
KV cache's budget."""

from __future__ import annotations

import glob
import json
import os
from typing import Optional

from backend.models.architectures import ARCHITECTURES
from backend.models.config import ModelConfig

_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "I8": 1, "U8": 1, "I32": 4, "I64": 8}
TOWER_PREFIXES = ("visual.", "model.visual.", "vision_tower.", "model.vision_tower.", "multi_modal_projector.",
                  "model.multi_modal_projector.")


def tower_bytes(checkpoint: str) -> int:
    """Bytes of the vision tower's (and projector's) tensors in the checkpoint's files."""
    total = 0
    for path in glob.glob(os.path.join(checkpoint, "*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__" and name.startswith(TOWER_PREFIXES):
                n = 1
                for d in entry["shape"]:
                    n *= d
                total += n * _DTYPE_BYTES.get(entry["dtype"], 2)
    return total


def max_image_tokens(checkpoint: str, cfg: ModelConfig) -> int:
    """The most tokens one image becomes (the image processor's max_pixels over one
    merged token's pixels); Qwen2-VL's defaults when the folder has no processor config."""
    vision = cfg.hf_config.get("vision_config") or {}
    side = int(vision.get("patch_size", 14)) * int(vision.get("spatial_merge_size", 2))
    max_pixels = 28 * 28 * 1280
    path = os.path.join(checkpoint, "preprocessor_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            pre = json.load(f)
        max_pixels = (pre.get("size") or {}).get("longest_edge") or pre.get("max_pixels") or max_pixels
    return int(max_pixels) // (side * side)


def vision_plan(checkpoint: str, cfg: ModelConfig, max_num_batched_tokens: int,
                max_num_encoder_input_tokens: Optional[int], encoder_cache_size: Optional[int],
                act_bytes: int) -> Optional[dict]:
    """None for a text-only model. The encoder budget and cache size default as the
    engine's do (backend/engine/vision.py)."""
    if not ARCHITECTURES[cfg.architecture].vision:
        return None
    budget = max_num_encoder_input_tokens or max(max_num_batched_tokens, max_image_tokens(checkpoint, cfg))
    rows = encoder_cache_size or budget
    return {"vision_tower_bytes": tower_bytes(checkpoint), "encoder_cache_rows": rows,
            "encoder_cache_bytes": rows * cfg.hidden_size * act_bytes}
