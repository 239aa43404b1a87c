"""The sparse mixture-of-experts block (Mixtral, Qwen2-MoE, Qwen3-MoE) and how its
checkpoint tensors become the engine's.

A router (`gate`, [E, H]) scores the experts; LayerOps.moe_route takes softmax, top-k
and the optional renormalization in one function; LayerOps.fused_moe runs the k experts
of every token (the torch reference on CPU, the Triton kernel with
attention_backend="triton"). Qwen2-MoE adds an always-on shared expert scaled by
sigmoid(shared_expert_gate(x)). gpt-oss (MoEConfig.router_bias and the rest): a biased
router, softmax over the top-k logits, biased experts and the clamped SwiGLU.

Weights: the checkpoint's per-expert gate/up/down (Mixtral's w1/w3/w2) are stacked at
load into `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I], the
layout the grouped GEMMs read. Under tensor parallelism every rank holds every expert
with 1/tp of its channels (sliced like the dense MLP, backend/parallel/sharding.py);
the partial outputs of the experts and the shared expert are summed by one all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from backend.models.config import ModelConfig
from backend.models.moe_config import MoEConfig
from backend.ops import LayerOps
from backend.parallel.group import TensorParallel


class StackedExperts(nn.Module):
    def __init__(self, moe: MoEConfig, hidden: int) -> None:
        super().__init__()
        E, inter = moe.num_local_experts, moe.intermediate_size
        self.gate_up_proj_scale = self.down_proj_scale = None
        self.quantized = False          # FP8 builds: swapped in by moe_fp8.swap_in_fp8_experts
        if moe.packed_mxfp4:
            # MXFP4: two E2M1 codes a byte, one E8M0 scale per 32 inputs (backend/ops/mxfp4.py).
            def packed(rows: int, cols: int, div: int) -> nn.Parameter:
                return nn.Parameter(torch.empty(E, rows, cols // div, dtype=torch.uint8), requires_grad=False)
            self.gate_up_proj, self.gate_up_proj_scale = packed(2 * inter, hidden, 2), packed(2 * inter, hidden, 32)
            self.down_proj, self.down_proj_scale = packed(hidden, inter, 2), packed(hidden, inter, 32)
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inter, hidden), requires_grad=False)
            self.down_proj = nn.Parameter(torch.empty(E, hidden, inter), requires_grad=False)
        # gpt-oss: per-expert biases of gate_up ([gate | up], like the rows) and down.
        self.gate_up_proj_bias = self.down_proj_bias = None
        if moe.expert_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * inter), requires_grad=False)
            self.down_proj_bias = nn.Parameter(torch.empty(E, hidden), requires_grad=False)


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP without its own all-reduce (the block sums once)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: LayerOps, tp: TensorParallel) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.moe, self.ops, self.tp, self.act = moe, ops, tp, moe.activation or cfg.hidden_act
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=moe.router_bias)
        self.experts = StackedExperts(moe, cfg.hidden_size)
        self.has_shared = moe.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = SharedExpert(cfg.hidden_size, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.ops.moe_route(self.gate(x), self.moe.top_k, self.moe.norm_topk_prob,
                                          softmax_after_topk=self.moe.softmax_after_topk)
        if self.moe.expert_parallel and self.tp.size > 1:
            # This rank's experts get local ids; the others' slots become -1 (no contribution).
            n = self.moe.num_local_experts
            ids = ids - self.tp.rank * n
            ids = ids.masked_fill((ids < 0) | (ids >= n), -1)
        e = self.experts
        extra = {}
        if e.gate_up_proj_bias is not None:
            extra = dict(b13=e.gate_up_proj_bias, b2=e.down_proj_bias)
        if self.act == "swigluoai":
            extra.update(alpha=self.moe.swiglu_alpha, limit=self.moe.swiglu_limit)
        if e.gate_up_proj_scale is not None:
            extra.update(w13_scale=e.gate_up_proj_scale, w2_scale=e.down_proj_scale)
        out = self.ops.fused_moe(x, e.gate_up_proj, e.down_proj, weights, ids, self.act, **extra)
        if self.has_shared:
            s = self.shared_expert
            shared = s.down_proj(self.ops.act_and_mul(s.gate_up_proj(x), self.act))
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return self.tp.all_reduce(out)


def stack_experts(state: dict[str, torch.Tensor], cfg: ModelConfig, rank: int = 0) -> dict[str, torch.Tensor]:
    """Rename and stack a MoE checkpoint's expert tensors (in place): per layer
    `<block>.experts.<e>.<gate|up|down>.weight` -> `mlp.experts.gate_up_proj` [E, 2I, H]
    and `mlp.experts.down_proj` [E, H, I]; `<block>.gate` -> `mlp.gate`; the shared
    expert's gate/up are fused like the dense MLP's. cfg: this rank's (local_config);
    with expert parallelism the rank's experts are [rank * n, (rank + 1) * n)."""
    moe = cfg.moe
    if moe is None:
        return state
    gate_name, up_name, down_name = moe.checkpoint_projections
    for i, sparse in enumerate(moe.sparse_layers):
        if not sparse:
            continue
        src, dst = f"model.layers.{i}.{moe.checkpoint_block}", f"model.layers.{i}.mlp"
        first = rank * moe.num_local_experts if moe.expert_parallel else 0
        if f"{src}.experts.{first}.{gate_name}.weight" in state:
            experts = range(first, first + moe.num_local_experts)
            gate_up = [torch.cat([state.pop(f"{src}.experts.{e}.{gate_name}.weight"),
                                  state.pop(f"{src}.experts.{e}.{up_name}.weight")]) for e in experts]
            state[f"{dst}.experts.gate_up_proj"] = torch.stack(gate_up)
            state[f"{dst}.experts.down_proj"] = torch.stack(
                [state.pop(f"{src}.experts.{e}.{down_name}.weight") for e in experts])
        # An FP8 build holds transformers' own names: experts stacked, the router under mlp.
        if src != dst and f"{src}.gate.weight" in state:
            state[f"{dst}.gate.weight"] = state.pop(f"{src}.gate.weight")
        shared = f"{dst}.shared_expert"
        if f"{shared}.gate_proj.weight" in state:
            state[f"{shared}.gate_up_proj.weight"] = torch.cat([state.pop(f"{shared}.gate_proj.weight"),
                                                                state.pop(f"{shared}.up_proj.weight")])
    return state
