"""What the drafter heads (EAGLE-3, EAGLE-1, Medusa) share: reading a head's folder,
placing its weights, and for EAGLE heads the paged decoder the draft-model machinery
runs (eagle3.py, eagle1.py, medusa.py)."""

from __future__ import annotations

import glob
import json
import os
from typing import Optional

import torch
from torch import nn

from backend.models.config import ModelConfig
from backend.models.rotary import RotaryEmbedding


class HeadConfigError(ValueError):
    pass


def read_config(path: str) -> dict:
    """A head folder's config.json."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise HeadConfigError(f"no checkpoint (config.json) in '{path}'")
    with open(cfg_path) as f:
        return json.load(f)


def read_state(path: str) -> dict[str, torch.Tensor]:
    """A head's tensors: its *.safetensors, else its pytorch_model*.bin or *.pt (read with
    weights_only: tensors, no code)."""
    from safetensors.torch import load_file
    state: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        state.update(load_file(f))
    if not state:
        for f in sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")) + glob.glob(os.path.join(path, "*.pt"))):
            state.update(torch.load(f, map_location="cpu", weights_only=True))
    if not state:
        raise HeadConfigError(f"no weights (*.safetensors, pytorch_model*.bin or *.pt) in '{path}'")
    return state


def place_weights(module: nn.Module, state: dict[str, torch.Tensor], path: str, dtype: torch.dtype,
                  device: torch.device) -> nn.Module:
    """`module` (built on the meta device, its buffers rebuilt) with exactly the weights
    `state` names, on `device` in `dtype`, for inference. Errors name what does not fit."""
    expected = {n for n, _ in module.named_parameters()}
    if set(state) != expected:
        raise HeadConfigError(f"'{path}': weights {sorted(set(state) - expected)[:4]} unexpected, "
                              f"{sorted(expected - set(state))[:4]} missing")
    try:
        module.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:               # (a tensor of the wrong shape)
        raise HeadConfigError(f"'{path}' does not fit its config.json: {str(e).splitlines()[-1].strip()}") from None
    return module.to(device=device, dtype=dtype).eval().requires_grad_(False)


class PagedDraftHead(nn.Module):
    """An EAGLE head as the draft-model machinery runs it: the decoder's forward signature
    over the paged cache, its hidden input read from `hidden_in` (a buffer at a fixed
    address, so CUDA graphs capture it), its output left in `captured_hidden`, and an LM
    head of its own or the target's."""

    def __init__(self, cfg: ModelConfig, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        self.lm_head: Optional[nn.Module] = None
        # The target's LM head when the head has none, in a tuple so that it is not
        # registered as the head's module (it may be oneDNN-packed).
        self.shared_lm_head: tuple = ()
        self.hidden_in: Optional[torch.Tensor] = None          # [max tokens, hidden]
        self.captured_hidden: Optional[torch.Tensor] = None
        self.build_buffers(max_position)

    def build_buffers(self, max_position: int) -> None:
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.rope_dim, max_position, cfg.rope_theta, cfg.rope_scaling)

    def allocate_hidden_input(self, max_tokens: int) -> None:
        p = next(self.parameters())     # (every parameter is in the compute dtype; linears may be packed)
        self.hidden_in = torch.zeros(max_tokens, self.config.hidden_size, dtype=p.dtype, device=p.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.lm_head if self.lm_head is not None else self.shared_lm_head[0])(hidden)
