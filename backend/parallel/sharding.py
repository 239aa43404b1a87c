"""Megatron-style tensor-parallel sharding of a Llama-family checkpoint, rank by rank.

- Column parallel (output rows split): q/k/v (by attention head), gate/up (by
  intermediate channel), with their biases and FP8 per-channel scales.
- Row parallel (input columns split): o_proj, down_proj. Each rank's partial output is
  summed by one all-reduce; a bias is added once, by rank 0.
- Vocab parallel: embedding and LM head rows, padded to a multiple of the ranks.
- KV heads split like the query heads they serve; with fewer KV heads than ranks each is
  replicated on tp / num_kv_heads ranks (vLLM's rule), so every rank's query heads find
  their KV head locally.

Each rank reads only its slices from the safetensors files (safe_open's lazy slices).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from typing import Callable, Optional

import torch
from safetensors import safe_open

from backend.models.architectures import ARCHITECTURES
from backend.models.config import ModelConfig
from backend.parallel.moe_sharding import ROW_BIAS, SKIP, check_moe_parallel, expert_rule

_LAYER = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(\w+)\.(weight|bias|weight_scale|input_scale)$")


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> Optional[str]:
    """Why this checkpoint cannot be split over tp ranks, or None."""
    if tp == 1:
        return None
    single_rank = ARCHITECTURES[cfg.architecture].single_rank
    if single_rank:
        return f"{cfg.architecture} runs on one rank: {single_rank}"
    if cfg.num_heads % tp:
        return f"{cfg.num_heads} attention heads do not divide over {tp} ranks"
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        return f"{cfg.num_kv_heads} KV heads neither divide over {tp} ranks nor divide {tp} (to be replicated)"
    if cfg.intermediate_size % tp:
        return f"intermediate_size {cfg.intermediate_size} does not divide over {tp} ranks"
    return check_moe_parallel(cfg, tp)


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The shapes one rank builds: its heads, KV heads and MLP channels."""
    if tp == 1:
        return cfg
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=max(1, cfg.num_kv_heads // tp),
                               intermediate_size=cfg.intermediate_size // tp,
                               moe=None if cfg.moe is None else cfg.moe.local(tp))


def local_vocab_size(cfg: ModelConfig, tp: int) -> int:
    return -(-cfg.vocab_size // tp)


def kv_head_range(cfg: ModelConfig, rank: int, tp: int) -> tuple[int, int]:
    if cfg.num_kv_heads >= tp:
        n = cfg.num_kv_heads // tp
        return rank * n, (rank + 1) * n
    head = rank // (tp // cfg.num_kv_heads)
    return head, head + 1


def _rule(name: str, cfg: ModelConfig, rank: int, tp: int) -> Optional[tuple[int, int, int]]:
    """(dim, start, stop) of this rank's slice of a checkpoint tensor; None: replicated."""
    hd = cfg.head_dim
    expert = expert_rule(name, cfg, rank, tp)
    if expert is not None:
        return expert                               # a (dim, start, stop) or SKIP
    if name.endswith("self_attn.sinks"):            # gpt-oss: one per query head
        n = cfg.num_heads // tp
        return 0, rank * n, (rank + 1) * n
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        n = local_vocab_size(cfg, tp)
        return 0, rank * n, (rank + 1) * n
    m = _LAYER.match(name)
    if m is None:
        return None                                 # norms
    proj, kind = m.group(2), m.group(3)
    if kind == "input_scale":
        return None                                 # one scale for the whole input
    if proj == "q_proj":
        n = cfg.num_heads // tp * hd
        return 0, rank * n, (rank + 1) * n
    if proj in ("k_proj", "v_proj"):
        a, b = kv_head_range(cfg, rank, tp)
        return 0, a * hd, b * hd
    if proj in ("gate_proj", "up_proj"):
        n = cfg.intermediate_size // tp
        return 0, rank * n, (rank + 1) * n
    if proj in ("o_proj", "down_proj") and kind == "weight":
        n = (cfg.num_heads * hd if proj == "o_proj" else cfg.intermediate_size) // tp
        return 1, rank * n, (rank + 1) * n
    return None                                     # row-parallel biases and per-output scales


def weight_slice(name: str, cfg: ModelConfig, rank: int, tp: int) -> tuple[int, int, int]:
    """(dim, start, stop) of a projection weight's slice on this rank (the LoRA adapters
    split the same way)."""
    rule = _rule(name, cfg, rank, tp)
    assert rule is not None, name
    return rule


def load_shard(path: str, cfg: ModelConfig, rank: int, tp: int,
               keep: Optional[Callable[[str], bool]] = None) -> dict[str, torch.Tensor]:
    """This rank's tensors of the checkpoint, under the checkpoint's names; with `keep`
    (a pipeline stage's), only the tensors it keeps are read."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in checkpoint folder '{path}'")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if keep is not None and not keep(name):
                    continue
                rule = _rule(name, cfg, rank, tp)
                if rule == SKIP:
                    continue                        # another rank's expert
                if rule is None or rule == ROW_BIAS:
                    tensor = f.get_tensor(name)
                    if rank > 0 and (rule == ROW_BIAS or _is_row_parallel_bias(name)):
                        tensor = torch.zeros_like(tensor)   # added once, by rank 0
                    state[name] = tensor
                else:
                    state[name] = _read_slice(f.get_slice(name), *rule)
    return state


def _is_row_parallel_bias(name: str) -> bool:
    return name.endswith(("o_proj.bias", "down_proj.bias"))


def _read_slice(sl, dim: int, start: int, stop: int) -> torch.Tensor:
    """Indices [start, stop) along `dim` of a lazily opened tensor; rows past its end
    (vocab padding) are zeros."""
    shape = sl.get_shape()
    end = max(start, min(stop, shape[dim]))
    part = sl[(slice(None),) * dim + (slice(start, end),)]
    if end == stop:
        return part
    pad_shape = list(part.shape)
    pad_shape[dim] = stop - end
    return torch.cat([part, torch.zeros(pad_shape, dtype=part.dtype)], dim=dim)
