"""What a speculative drafter adds to the memory plan: its weights (in the compute dtype,
whatever the target's weight format) and its K/V per token, which lives in the target's
blocks (a draft model's layers, an EAGLE-3 head's one layer; Medusa heads and n-gram
lookup keep none)."""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass

from backend.config import SpeculativeConfig


@dataclass(frozen=True)
class Drafter:
    params: int = 0                 # parameters the drafter holds beyond the target's
    kv_elems_per_token: int = 0     # its K and V elements per token (x the KV dtype's bytes)

    def weight_bytes(self, act_bytes: int = 2) -> int:
        return self.params * act_bytes


NONE = Drafter()


def _param_count(path: str) -> int:
    """Elements of every tensor in the folder's weight files, read from their headers
    (safetensors) or by loading them (.bin / .pt); integer maps (d2t) included."""
    from safetensors import safe_open
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    n = 0
    for f in files:
        with safe_open(f, "pt") as st:
            for k in st.keys():
                shape = st.get_slice(k).get_shape()
                n += math.prod(shape)
    if files:
        return n
    import torch
    for f in sorted(glob.glob(os.path.join(path, "*.bin")) + glob.glob(os.path.join(path, "*.pt"))):
        n += sum(t.numel() for t in torch.load(f, map_location="cpu", weights_only=True).values())
    return n


def drafter(spec: SpeculativeConfig | None) -> Drafter:
    if spec is None or spec.method == "ngram":
        return NONE
    params = _param_count(spec.model)
    if spec.method == "medusa":
        return Drafter(params, 0)
    with open(os.path.join(spec.model, "config.json")) as f:
        hf = json.load(f)
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    layers = 1 if spec.method == "eagle3" else hf["num_hidden_layers"]
    return Drafter(params, 2 * layers * hf.get("num_key_value_heads", heads) * head_dim)
