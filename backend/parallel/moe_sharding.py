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

gpt-oss stores each layer's experts stacked (`mlp.experts.gate_up_proj` [E, H, 2I] with
gate/up columns interleaved, `down_proj` [E, I, H], biases [E, 2I] and [E, H]; or MXFP4
`*_blocks` [E, out, in/32, 16] and `*_scales` [E, out, in/32]): channel slices are
contiguous there too (channels [a, b) are interleaved columns [2a, 2b)), along the
tensor's own dimension; the down bias is added by rank 0 alone (a row-parallel bias),
and with expert parallelism every stacked tensor is cut along E. MXFP4 down blocks
split by 32-channel scale groups, so I/tp must be a multiple of 32 there.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Union

from backend.models.config import ModelConfig
from backend.models.moe_config import MoEConfig

_EXPERT = re.compile(r"^model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.(weight|weight_scale)$")
_STACKED = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
_SHARED = re.compile(r"^model\.layers\.\d+\.mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale)$")
SKIP = "skip"   # a tensor this rank does not read
ROW_BIAS = "row_bias"   # a bias after a channel-split GEMM: rank 0 adds it, the others hold zeros


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
    if (cfg.mxfp4_experts and not moe.expert_parallel and moe.intermediate_size // tp % 32):
        return (f"MXFP4 experts split by channel need intermediate_size / {tp} to be a multiple of 32 "
                f"(it is {moe.intermediate_size // tp}): use enable_expert_parallel")
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
    m = _STACKED.match(name)
    if m is not None:
        return _stacked_slice(m.group(1), m.group(2) or "", moe, rank, tp)
    return None


def _stacked_slice(proj: str, suffix: str, moe: MoEConfig, rank: int, tp: int) -> Union[str, tuple[int, int, int]]:
    """gpt-oss's stacked experts: (dim, start, stop), or ROW_BIAS for the down bias."""
    if moe.expert_parallel:
        n = moe.num_experts // tp
        return 0, rank * n, (rank + 1) * n
    n = moe.intermediate_size // tp
    if proj == "gate_up_proj":      # interleaved gate/up: channels [a, b) are [2a, 2b)
        dim = {"": 2, "_bias": 1, "_blocks": 1, "_scales": 1}[suffix]
        return dim, 2 * rank * n, 2 * (rank + 1) * n
    if suffix == "_bias":
        return ROW_BIAS
    if suffix in ("_blocks", "_scales"):   # [E, H, I/32, ..]: whole scale groups
        return 2, rank * n // 32, (rank + 1) * n // 32
    return 1, rank * n, (rank + 1) * n      # [E, I, H]


def _channel_slice(is_down: bool, kind: str, n: int, rank: int) -> Optional[tuple[int, int, int]]:
    if is_down:
        return (1, rank * n, (rank + 1) * n) if kind == "weight" else None   # per-output scales stay whole
    return 0, rank * n, (rank + 1) * n
