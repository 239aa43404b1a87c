"""Attention backends behind one interface: forward(q, k, v, cache, meta) -> out."""

from __future__ import annotations

import os
from typing import Callable

import torch

from backend.config import ConfigError


def resolve_attention_backend(name: str, device: torch.device) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("invalid engine argument 'attention_backend': 'triton' on CPU needs "
                          "TRITON_INTERPRET=1 set before start-up (the Triton interpreter)")
    return name


def make_attention_factory(name: str) -> Callable[..., object]:
    if name == "triton":
        from backend.attention.triton_attention import TritonPagedAttention
        return TritonPagedAttention
    from backend.attention.torch_attention import TorchPagedAttention
    return TorchPagedAttention
