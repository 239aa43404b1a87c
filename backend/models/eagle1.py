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

from typing import Callable

import torch
from torch import nn

from backend.attention.metadata import AttentionMetadata, KVCacheLayer
from backend.models.config import ModelConfig, model_config_from_dict
from backend.models.draft_heads import HeadConfigError, PagedDraftHead, place_weights, read_config, read_state
from backend.models.llama import DecoderLayer
from backend.models.loader import fuse_projections
from backend.ops import LayerOps
from backend.parallel.group import SINGLE


class Eagle1Head(PagedDraftHead):
    draft_to_target = None          # (no reduced vocabulary: the target's)

    def __init__(self, cfg: ModelConfig, fc_bias: bool, own_lm_head: bool, attn_factory: Callable[..., object],
                 ops: LayerOps, max_position: int) -> None:
        super().__init__(cfg, max_position)
        self.ops = ops
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, attn_factory, ops, SINGLE) for i in range(cfg.num_layers))
        if own_lm_head:             # (the authors' heads have none: the target's, shared_lm_head)
            self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)

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


def load_eagle1_head(path: str, target, attn_factory: Callable[..., object], ops: LayerOps, dtype: torch.dtype,
                     device: torch.device, max_position: int) -> tuple[Eagle1Head, ModelConfig]:
    hf = read_config(path)
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
    head.build_buffers(max_position)
    head = place_weights(head, state, path, dtype, device)
    if head.lm_head is None:
        head.shared_lm_head = (target.lm_head,)
    return head, cfg
