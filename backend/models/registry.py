"""The model class that serves a checkpoint's architecture (backend/models/architectures.py)."""

from __future__ import annotations

import importlib

from backend.models.architectures import ARCHITECTURES
from backend.models.config import ModelConfig
from backend.models.llama import CausalLM


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    entry = ARCHITECTURES[cfg.architecture]
    return getattr(importlib.import_module(f"backend.models.{entry.module}"), entry.model_class)
