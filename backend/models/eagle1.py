"""An EAGLE-1/2 draft head (arXiv 2401.15077) in the published checkpoint layout: vLLM's
`method: "eagle"`.

The head predicts the target's next final hidden state (after its final norm) and scores
it with the target's own LM head:
- `fc` fuses [embedding of token p + 1, hidden state at p] (2 x hidden, with a bias in
  the authors' checkpoints) into the first layer's input;
- then Llama decoder layers, the first without its input norm, and no final norm: the
  output is the residual stream, which is both the next position's hidden input and what
  the LM head scores.
The first position of a draft reads the target's final hidden state; every later one the
head's own output. (EAGLE-2's dynamic tree changes how the tree is drafted, not the
head; trees are not built here: chains only.)

Checkpoints: config.json of a Llama (`num_hidden_layers` of the head, usually 1);
weights `fc.weight` (and `fc.bias`), `layers.{i}.*` (or `model.layers.{i}.*`), optionally
`embed_tokens.weight` and `lm_head.weight` (else the target's), in safetensors or
pytorch_model.bin. Its forward has the decoder's signature, its hidden input read from
`hidden_in`, as the EAGLE-3 head's (eagle3.py).
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

import torch
from torch import nn

from backend.attention.metadata import AttentionMetadata, KVCacheLayer
from backend.models.config import ModelConfig, model_config_from_dict
from backend.models.eagle3 import HeadConfigError, read_state
from backend.models.llama import DecoderLayer
from backend.models.loader import fuse_projections
from backend.models.rotary import RotaryEmbedding
from backend.ops import LayerOps
from backend.parallel.group import SINGLE


class Eagle1Head(nn.Module):
    def __init__(self, cfg: ModelConfig, fc_bias: bool, own_lm_head: bool, attn_factory: Callable[..., object],
                 ops: LayerOps, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        self.ops = ops
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, attn_factory, ops, SINGLE) for i in range(cfg.num_layers))
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False) if own_lm_head else None
        # The target's LM head when the head has none (as the authors' heads do), in a
        # tuple so that it is not registered as a module of the head (it may be packed).
        self.shared_lm_head: tuple = ()
        self.draft_to_target = None         # (no reduced vocabulary: the target's)
        self.hidden_in: Optional[torch.Tensor] = None
        self.captured_hidden: Optional[torch.Tensor] = None
        self.build_buffers(max_position)

    def build_buffers(self, max_position: int) -> None:
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.rope_dim, max_position, cfg.rope_theta, cfg.rope_scaling)

    def allocate_hidden_input(self, max_tokens: int) -> None:
        p = self.layers[0].post_attention_layernorm.weight
        self.hidden_in = torch.zeros(max_tokens, self.config.hidden_size, dtype=p.dtype, device=p.device)

    def combine(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's final hidden states are the head's hidden input as they are."""
        return hidden.to(self.hidden_in.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCacheLayer],
                meta: AttentionMetadata) -> torch.Tensor:
        """The predicted next hidden states [T, hidden] (also left in `captured_hidden`)."""
        ops = self.ops
        x = self.fc(torch.cat([self.embed_tokens(input_ids), self.hidden_in[:input_ids.shape[0]]], dim=-1))
        residual = None
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            if i == 0:          # the first layer has no input norm
                h, residual = x, x
            else:
                norm = layer.input_layernorm
                h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
            h = layer.self_attn(h, positions, self.rotary, cache, meta)
            norm = layer.post_attention_layernorm
            h, residual = ops.add_rms_norm(h, residual, norm.weight, norm.eps)
            x = layer.mlp(h)
        self.captured_hidden = x + residual
        return self.captured_hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.lm_head if self.lm_head is not None else self.shared_lm_head[0])(hidden)


def load_eagle1_head(path: str, target, attn_factory: Callable[..., object], ops: LayerOps, dtype: torch.dtype,
                     device: torch.device, max_position: int) -> tuple[Eagle1Head, ModelConfig]:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise HeadConfigError(f"no checkpoint (config.json) in '{path}'")
    with open(cfg_path) as f:
        hf = json.load(f)
    if "LlamaForCausalLMEagle3" in (hf.get("architectures") or []) or "draft_vocab_size" in hf:
        raise HeadConfigError(f"'{path}' is an EAGLE-3 head: use method 'eagle3'")
    cfg = model_config_from_dict({**hf, "architectures": ["LlamaForCausalLM"]})
    tcfg = target.config
    if (cfg.vocab_size, cfg.hidden_size) != (tcfg.vocab_size, tcfg.hidden_size):
        raise HeadConfigError(f"the head is for hidden size {cfg.hidden_size} and {cfg.vocab_size} tokens; the "
                              f"target has {tcfg.hidden_size} and {tcfg.vocab_size}")
    state = {}
    for name, t in read_state(path).items():
        state[name[len("model."):] if name.startswith("model.") and not name.startswith("model.lm_head") else name] = t
    if "fc.weight" not in state:
        raise HeadConfigError(f"'{path}' is not an EAGLE head (no fc.weight)")
    state = {k.replace("model.layers.", "layers."): v
             for k, v in fuse_projections({("model." + k if k.startswith("layers.") else k): v
                                           for k, v in state.items()}, cfg.num_layers).items()}
    with torch.device("meta"):
        head = Eagle1Head(cfg, "fc.bias" in state, "lm_head.weight" in state, attn_factory, ops, max_position)
    state.setdefault("embed_tokens.weight", target.model.embed_tokens.weight)
    state.setdefault("layers.0.input_layernorm.weight", torch.ones(cfg.hidden_size))     # (never applied)
    expected = {n for n, _ in head.named_parameters()}
    if set(state) - expected or expected - set(state):
        raise HeadConfigError(f"'{path}': weights {sorted(set(state) - expected)[:4]} unexpected, "
                              f"{sorted(expected - set(state))[:4]} missing")
    try:
        head.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:               # (a tensor of the wrong shape)
        raise HeadConfigError(f"'{path}' does not fit its config.json: {str(e).splitlines()[-1].strip()}") from None
    head.build_buffers(max_position)
    head = head.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if head.lm_head is None:
        head.shared_lm_head = (target.lm_head,)
    return head, cfg
