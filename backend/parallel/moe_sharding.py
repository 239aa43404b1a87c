"""How a mixture-of-experts checkpoint's expert tensors split over tensor-parallel ranks.

- Default (vLLM's without --enable-expert-parallel): every rank holds every expert with
  1/tp of its channels, sliced like the dense MLP: gate/up (Mixtral w1/w3) by output
  rows, down (w2) by input columns. The shared expert splits the same way. Each rank's
  partial sum goes into the block's one all-reduce.
- enable_expert_parallel: rank r holds experts [r * E/tp, (r + 1) * E/tp) whole and reads
  no others; tokens routed elsewhere contribute zero on this rank, and the same
  all-reduce sums the ranks' contributions (an all-reduce rather than an all-to-all: the
  hidden states are already replicated on every rank after attention). The shared
  expert stays channel-sliced.
The router (`gate`) and `shared_expert_gate` are replicated.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Union

from backend.models.config import ModelConfig

_EXPERT = re.compile(r"^model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.(weight|weight_scale)$")
_SHARED = re.compile(r"^model\.layers\.\d+\.mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale)$")
SKIP = "skip"   # a tensor this rank does not read


def with_expert_parallel(cfg: ModelConfig, enable: bool) -> ModelConfig:
    if not enable or cfg.moe is None:
        return cfg
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, expert_parallel=True))


def check_moe_parallel(cfg: ModelConfig, tp: int) -> Optional[str]:
    moe = cfg.moe
    if moe is None or tp == 1:
        return None
    if moe.expert_parallel and moe.num_experts % tp:
        return f"{moe.num_experts} experts do not divide over {tp} ranks (enable_expert_parallel)"
    if not moe.expert_parallel and moe.intermediate_size % tp:
        return f"moe_intermediate_size {moe.intermediate_size} does not divide over {tp} ranks"
    if moe.shared_expert_intermediate_size % tp:
        return f"shared_expert_intermediate_size {moe.shared_expert_intermediate_size} does not divide over {tp} ranks"
    return None


def expert_rule(name: str, cfg: ModelConfig, rank: int, tp: int) -> Union[None, str, tuple[int, int, int]]:
    """(dim, start, stop) of this rank's slice of an expert tensor, SKIP for another
    rank's expert, None for a tensor that is not an expert's (or is replicated)."""
    moe = cfg.moe
    if moe is None:
        return None
    m = _EXPERT.match(name)
    if m is not None:
        expert, proj, kind = int(m.group(1)), m.group(2), m.group(3)
        if moe.expert_parallel:
            per_rank = moe.num_experts // tp
            return None if expert // per_rank == rank else SKIP
        return _channel_slice(proj == moe.checkpoint_projections[2], kind, moe.intermediate_size // tp, rank)
    m = _SHARED.match(name)
    if m is not None:
        n = moe.shared_expert_intermediate_size // tp
        return _channel_slice(m.group(1) == "down_proj", m.group(2), n, rank)
    return None


def _channel_slice(is_down: bool, kind: str, n: int, rank: int) -> Optional[tuple[int, int, int]]:
    if is_down:
        return (1, rank * n, (rank + 1) * n) if kind == "weight" else None   # per-output scales stay whole
    return 0, rank * n, (rank + 1) * n
