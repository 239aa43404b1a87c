"""Medusa heads (arXiv 2401.10774) in the published checkpoint layouts.

Head i reads the target's final hidden state at its last computed position p (after
the final norm) and guesses token p + 2 + i: the one after the token the target itself
samples there. Each head is `medusa_num_layers` residual blocks, x + SiLU(W x + b), then
an LM head of its own, or the target's (`original_lm_head`). No K/V, no forward of a
second network: k proposals cost k small GEMMs on the rows that propose.

Checkpoints:
- the Medusa authors' (FasterDecoding/Medusa): config.json with `medusa_num_heads` and
  `medusa_num_layers`; weights `{i}.{j}.linear.weight|bias` for the blocks and
  `{i}.{L}.weight` for head i's LM head (in `medusa_lm_head.safetensors` or `.pt`,
  optionally prefixed `medusa_head.`);
- vLLM's (`MedusaModel`: `num_heads`, `num_hidden_layers`): `blocks.{i}.layers.{j}.weight|bias`
  and `lm_heads.{i}.weight`.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from backend.models.draft_heads import HeadConfigError, place_weights, read_config, read_state


class MedusaConfigError(HeadConfigError):
    pass


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int,
                 original_lm_head: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.blocks = nn.ModuleList(nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers))
                                    for _ in range(num_heads))
        self.lm_heads = None if original_lm_head else nn.ModuleList(
            nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))
        # (the target's LM head, when the heads share it: in a tuple, so that it is not
        # registered as a module of the heads)
        self.shared_lm_head: tuple = ()

    def logits(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        """Head i's logits [R, vocab] for final hidden states [R, hidden]."""
        x = hidden
        for linear in self.blocks[i]:
            x = x + F.silu(linear(x))
        return self.lm_heads[i](x) if self.lm_heads is not None else self.shared_lm_head[0](x)


def _our_names(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        n = name[len("medusa_head."):] if name.startswith("medusa_head.") else name
        m = re.fullmatch(r"(\d+)\.(\d+)\.linear\.(weight|bias)", n)
        if m:
            n = f"blocks.{m[1]}.{m[2]}.{m[3]}"
        elif (m := re.fullmatch(r"(\d+)\.(\d+)\.weight", n)) and int(m[2]) == num_layers:
            n = f"lm_heads.{m[1]}.weight"
        elif (m := re.fullmatch(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)", n)):
            n = f"blocks.{m[1]}.{m[2]}.{m[3]}"
        out[n] = t
    return out


def load_medusa_heads(path: str, target, dtype: torch.dtype, device: torch.device) -> MedusaHeads:
    hf = read_config(path)
    num_heads = hf.get("medusa_num_heads", hf.get("num_heads"))
    num_layers = hf.get("medusa_num_layers", hf.get("num_hidden_layers"))
    if num_heads is None or num_layers is None:
        raise MedusaConfigError(f"'{path}' is not a Medusa checkpoint (config.json has neither medusa_num_heads "
                                f"and medusa_num_layers nor num_heads and num_hidden_layers)")
    tcfg = target.config
    hidden = hf.get("hidden_size", tcfg.hidden_size)
    vocab = hf.get("vocab_size", tcfg.vocab_size)
    if hidden != tcfg.hidden_size or vocab != tcfg.vocab_size:
        raise MedusaConfigError(f"the heads are for hidden size {hidden} and {vocab} tokens; the target has "
                                f"{tcfg.hidden_size} and {tcfg.vocab_size}")
    state = _our_names(read_state(path), int(num_layers))
    original = bool(hf.get("original_lm_head", False)) and not any(k.startswith("lm_heads.") for k in state)
    with torch.device("meta"):
        heads = MedusaHeads(hidden, vocab, int(num_heads), int(num_layers), original)
    heads = place_weights(heads, state, path, dtype, device)
    if original:
        heads.shared_lm_head = (target.lm_head,)
    return heads
