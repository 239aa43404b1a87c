"""Mixture-of-experts facts of a checkpoint's config.json (Mixtral, Qwen2-MoE, Qwen3-MoE,
gpt-oss).

Which layers are sparse follows Hugging Face's Qwen2-MoE / Qwen3-MoE rule: layer i has
experts unless it is in `mlp_only_layers`, and only when (i + 1) is a multiple of
`decoder_sparse_step`; the other layers keep a dense MLP of `intermediate_size`.
Mixtral's layers are all sparse, with experts of `intermediate_size` channels.
gpt-oss's too, with a router bias, softmax over the k selected logits (not over all E),
expert biases and the clamped SwiGLU (transformers' GptOssExperts._apply_gate).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional



@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int                          # experts per token (num_experts_per_tok)
    intermediate_size: int              # channels of one expert (this rank's under TP)
    norm_topk_prob: bool                # renormalize the top-k probabilities to sum to 1
    sparse_layers: tuple[bool, ...]     # per layer: experts (True) or the dense MLP
    shared_expert_intermediate_size: int = 0   # Qwen2-MoE: an always-on expert, sigmoid-gated
    # Checkpoint names: the block's module and its experts' (gate, up, down) projections.
    checkpoint_block: str = "mlp"
    checkpoint_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # enable_expert_parallel: whole experts per rank instead of channel slices
    # (backend/parallel/moe_sharding.py).
    expert_parallel: bool = False
    # Experts one rank holds under expert parallelism (local config); 0: all of them.
    experts_per_rank: int = 0
    # gpt-oss: the router has a bias; top-k is taken on the logits and the softmax runs
    # over the k chosen ones; experts have biases; activation "swigluoai" with
    # swiglu_alpha / swiglu_limit ((up + 1) * g * sigmoid(alpha * g), both clamped).
    router_bias: bool = False
    softmax_after_topk: bool = False
    expert_bias: bool = False
    activation: str = ""                # "" : the model's hidden_act (SwiGLU / GeGLU)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # gpt-oss's MXFP4 experts kept packed on the device: the Triton fused MoE kernel
    # decodes them in its tiles (set by the model when that kernel runs).
    packed_mxfp4: bool = False

    @property
    def num_local_experts(self) -> int:
        return self.experts_per_rank or self.num_experts

    def local(self, tp: int) -> "MoEConfig":
        """One rank's shapes under tensor parallelism: every expert with 1/tp of its
        channels, or with expert parallelism 1/tp of the experts whole (rank r's first
        expert is r * num_local_experts; the router still scores all num_experts)."""
        shared = self.shared_expert_intermediate_size // tp
        if self.expert_parallel:
            return dataclasses.replace(self, experts_per_rank=self.num_experts // tp,
                                       shared_expert_intermediate_size=shared)
        return dataclasses.replace(self, intermediate_size=self.intermediate_size // tp,
                                   shared_expert_intermediate_size=shared)


def _mixtral(cfg: dict[str, Any], num_layers: int) -> MoEConfig:
    return MoEConfig(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                     intermediate_size=cfg["intermediate_size"], norm_topk_prob=True,
                     sparse_layers=tuple(True for _ in range(num_layers)),
                     checkpoint_block="block_sparse_moe", checkpoint_projections=("w1", "w3", "w2"))


def _gpt_oss(cfg: dict[str, Any], num_layers: int) -> MoEConfig:
    return MoEConfig(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                     intermediate_size=cfg["intermediate_size"], norm_topk_prob=False,
                     sparse_layers=tuple(True for _ in range(num_layers)), router_bias=True,
                     softmax_after_topk=True, expert_bias=True, activation="swigluoai",
                     swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                     swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))


def _qwen(cfg: dict[str, Any], num_layers: int, shared_expert: bool = False) -> MoEConfig:
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; the published
    # checkpoints as num_experts. Only Qwen2-MoE has a shared expert.
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    return MoEConfig(num_experts=num_experts, top_k=cfg["num_experts_per_tok"],
                     intermediate_size=cfg["moe_intermediate_size"],
                     norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), sparse_layers=sparse,
                     shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0)
                     if shared_expert else 0)


# How each architecture's config.json states its experts (Architecture.moe).
READERS = {"mixtral": _mixtral, "gpt_oss": _gpt_oss, "qwen": _qwen,
           "qwen_shared_expert": lambda cfg, n: _qwen(cfg, n, shared_expert=True)}


def moe_config_from_dict(cfg: dict[str, Any], moe: str, num_layers: int) -> Optional[MoEConfig]:
    """`moe`: the architecture's MoE reading ("" for a dense model)."""
    return READERS[moe](cfg, num_layers) if moe else None
