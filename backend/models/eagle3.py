"""An EAGLE-3 draft head (arXiv 2503.01840) in the published checkpoint layout.

The head is one Llama decoder layer that predicts the target's next token from the
token and a feature of the target's state:
- `fc` fuses the target's residual stream entering a low, a middle and a high layer
  (concatenated, [3 x target hidden]) into one hidden vector;
- the layer's attention reads [RMSNorm(embedding of the token), RMSNorm(that vector)]
  concatenated (2 x hidden wide: its q/k/v projections are twice as wide as a Llama's),
  with the vector itself as the residual;
- its own final norm and LM head score a reduced draft vocabulary, mapped to the
  target's by `d2t` (target id = draft id + d2t[draft id]).
After its first position the head drafts from its own output (the residual stream before
its final norm), not the target's: that is what it was trained to continue from.

Checkpoints: config.json `LlamaForCausalLMEagle3` / `Eagle3LlamaForCausalLM` with the
layer's shapes, `draft_vocab_size` and optionally `eagle_config.eagle_aux_hidden_state_layer_ids`
(else vLLM's default: layers 2, L // 2 and L - 3 of an L-layer target); weights as the
EAGLE authors save them (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`, in
safetensors or pytorch_model.bin) or as vLLM names them (`model.layers.0.*`). Without
`embed_tokens` the head uses the target's embedding.

The head's forward has the decoder's signature (ids, positions, caches, metadata), so
the draft-model machinery (step inputs, paged K/V in the target's blocks, CUDA graphs)
runs it unchanged: its hidden input is read from `hidden_in`, a buffer at a fixed
address that the proposer fills before each forward.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from backend.attention.metadata import AttentionMetadata, KVCacheLayer
from backend.models.config import ModelConfig, model_config_from_dict
from backend.models.draft_heads import HeadConfigError, PagedDraftHead, place_weights, read_config, read_state
from backend.models.llama import MLP, Attention, RMSNorm
from backend.models.loader import fuse_projections
from backend.ops import LayerOps
from backend.parallel.group import SINGLE

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def head_config(path: str) -> tuple[ModelConfig, dict]:
    """(the layer's shapes as a one-layer Llama ModelConfig, config.json as read)."""
    hf = read_config(path)
    if not set(hf.get("architectures") or []) & set(ARCHITECTURES):
        raise HeadConfigError(f"'{path}' is not an EAGLE-3 head (architectures {hf.get('architectures')!r}; "
                              f"expected one of {list(ARCHITECTURES)})")
    return model_config_from_dict({**hf, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}), hf


def aux_layer_ids(hf: dict, target_layers: int) -> tuple[int, ...]:
    """The target layers whose incoming residual stream the head reads, in layer order."""
    ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (2, target_layers // 2, target_layers - 3)
    ids = tuple(sorted(set(int(i) for i in ids)))
    if len(ids) != 3 or not all(0 <= i < target_layers for i in ids):
        raise HeadConfigError(f"eagle_aux_hidden_state_layer_ids {list(ids)} must name three distinct layers of "
                              f"the target's {target_layers} (set it in the head's eagle_config)")
    return ids


class Eagle3Head(PagedDraftHead):
    def __init__(self, cfg: ModelConfig, target_hidden: int, draft_vocab: int, attn_factory: Callable[..., object],
                 ops: LayerOps, max_position: int, norm_before_residual: bool = False) -> None:
        super().__init__(cfg, max_position)
        self.ops = ops
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.fc = nn.Linear(3 * target_hidden, h, bias=False)
        self.self_attn = Attention(cfg, 0, attn_factory, ops, SINGLE)
        attn = self.self_attn
        attn.qkv_proj = nn.Linear(2 * h, attn.q_size + 2 * attn.kv_size, bias=cfg.qkv_bias)
        self.mlp = MLP(cfg, ops, SINGLE)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long), persistent=False)
        self.norm_before_residual = norm_before_residual

    @property
    def draft_to_target(self) -> Optional[torch.Tensor]:
        """[draft vocab]: each draft id's target id; None when the draft vocabulary is the
        target's (read once, at load)."""
        if len(self.d2t) == self.config.vocab_size and not bool(self.d2t.any()):
            return None
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's concatenated layer inputs -> the head's hidden input."""
        return self.fc(aux.to(self.norm.weight.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCacheLayer],
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]; the residual stream before it
        (what the next position drafts from) is left in `captured_hidden`. Row t's
        hidden input is hidden_in[t]."""
        ops = self.ops
        hidden = self.hidden_in[:input_ids.shape[0]]
        embeds = ops.add_rms_norm(self.embed_tokens(input_ids), None, self.input_layernorm.weight,
                                  self.input_layernorm.eps)[0]
        normed = ops.add_rms_norm(hidden, None, self.hidden_norm.weight, self.hidden_norm.eps)[0]
        residual = normed if self.norm_before_residual else hidden
        h = self.self_attn(torch.cat([embeds, normed], dim=-1), positions, self.rotary, kv_caches[0], meta)
        norm = self.post_attention_layernorm
        h, residual = ops.add_rms_norm(h, residual, norm.weight, norm.eps)
        out, self.captured_hidden = ops.add_rms_norm(self.mlp(h), residual, self.norm.weight, self.norm.eps)
        return out

    # compute_logits (PagedDraftHead's) scores the draft vocabulary: the proposer maps
    # its ids to the target's.


def _our_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The EAGLE authors' and vLLM's names -> this module's (q/k/v and gate/up fused)."""
    renamed = {}
    for name, t in state.items():
        n = name[len("model."):] if name.startswith("model.") else name
        for prefix in ("midlayer.", "layers.0."):
            if n.startswith(prefix):
                n = "model.layers.0." + n[len(prefix):]
        renamed[n] = t
    renamed = fuse_projections(renamed, 1)
    return {k.replace("model.layers.0.", ""): v for k, v in renamed.items()}


def load_eagle3_head(path: str, target, attn_factory: Callable[..., object], ops: LayerOps, dtype: torch.dtype,
                     device: torch.device, max_position: int) -> tuple[Eagle3Head, ModelConfig, tuple[int, ...]]:
    """(the head, its one-layer config for its K/V, the target layers it reads). The
    head's vocabulary must be the target's; its layer may be narrower than the target."""
    cfg, hf = head_config(path)
    tcfg = target.config
    if cfg.vocab_size != tcfg.vocab_size:
        raise HeadConfigError(f"the head's vocab_size {cfg.vocab_size} differs from the target's {tcfg.vocab_size}")
    ids = aux_layer_ids(hf, tcfg.num_layers)
    target_hidden = int(hf.get("target_hidden_size") or tcfg.hidden_size)
    if target_hidden != tcfg.hidden_size:
        raise HeadConfigError(f"the head was trained on a target of hidden size {target_hidden}, this one has "
                              f"{tcfg.hidden_size}")
    draft_vocab = int(hf.get("draft_vocab_size") or cfg.vocab_size)
    state = _our_names(read_state(path))
    state.pop("t2d", None)
    d2t = state.pop("d2t", None)
    with torch.device("meta"):
        head = Eagle3Head(cfg, target_hidden, draft_vocab, attn_factory, ops, max_position,
                          bool(hf.get("norm_before_residual", False)))
    if "embed_tokens.weight" not in state:
        state["embed_tokens.weight"] = target.model.embed_tokens.weight
    if "lm_head.weight" not in state and draft_vocab != tcfg.vocab_size:
        raise HeadConfigError(f"'{path}' has no lm_head for its {draft_vocab}-token draft vocabulary")
    if d2t is None and draft_vocab != tcfg.vocab_size:
        raise HeadConfigError(f"'{path}' has a {draft_vocab}-token draft vocabulary but no d2t map to the "
                              f"target's {tcfg.vocab_size} ids")
    shared = "lm_head.weight" not in state            # (the target's, shared as a module)
    if shared:
        head.lm_head = None
    head.d2t = d2t.to(torch.long) if d2t is not None else torch.zeros(draft_vocab, dtype=torch.long)
    if len(head.d2t) != draft_vocab:
        raise HeadConfigError(f"d2t has {len(head.d2t)} entries, draft_vocab_size is {draft_vocab}")
    head.build_buffers(max_position)        # (built on the meta device above)
    head = place_weights(head, state, path, dtype, device)
    if shared:
        head.shared_lm_head = (target.lm_head,)
    return head, cfg, ids
