"""Multi-LoRA serving: PEFT adapters (adapter.py) in device slots (manager.py), applied
per token by the wrapped projections (layers.py) with SGMV shrink/expand (punica.py)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from backend.config import ConfigError, EngineArgs
from backend.engine import sizing
from backend.lora.manager import LoRAManager, cache_salt
from backend.models.config import ModelConfig


def make_lora_manager(args: EngineArgs, cfg: ModelConfig, model: Optional[nn.Module], device: torch.device,
                      dtype: torch.dtype, kernel_backend: str, tp_rank: int = 0,
                      tp_size: int = 1) -> Optional[LoRAManager]:
    """The engine's adapters (this rank's shard of them), with the model's projections
    wrapped; None without enable_lora."""
    if not args.enable_lora or model is None:
        return None
    if cfg.moe is not None:
        raise ConfigError(f"invalid engine argument 'enable_lora': LoRA adapters on mixture-of-experts models "
                          f"({cfg.architecture}) are not supported yet")
    max_tokens = sizing.input_sizes(args, args.max_model_len or cfg.max_position_embeddings)[0]
    return LoRAManager(args, cfg, model, device, dtype, kernel_backend, max_tokens, tp_rank, tp_size)


__all__ = ["LoRAManager", "cache_salt", "make_lora_manager"]
