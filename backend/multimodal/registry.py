"""The multimodal processor of a vision-language architecture (its `vision` entry in
backend/models/architectures.py), imported when such a model loads."""

from __future__ import annotations

import importlib
from typing import Optional

from backend.models.architectures import ARCHITECTURES
from backend.models.config import ModelConfig

PROCESSORS = {"qwen2_vl": ("backend.multimodal.qwen2_vl", "Qwen2VLProcessor"),
              "llava": ("backend.multimodal.llava", "LlavaProcessor"),
              "gemma3": ("backend.multimodal.gemma3", "Gemma3Processor")}


def make_processor(model_path: str, cfg: ModelConfig) -> Optional[object]:
    """The processor, or None for a text-only model."""
    key = ARCHITECTURES[cfg.architecture].vision
    if not key:
        return None
    module, name = PROCESSORS[key]
    return getattr(importlib.import_module(module), name)(model_path, cfg.hf_config)
