"""Pipeline parallelism: the decoder's layers split into P contiguous stages, each stage
(of T tensor-parallel ranks) holding only its layers' weights and KV cache.

Stage 0 also holds the embedding, stage P-1 the final norm and the LM head (with tied
embeddings: its own copy of the embedding, read from the checkpoint as the head). The
split is vLLM's `get_pp_indices`: P near-equal parts, the extra layers going to the
stages before the last (which also runs the head). World rank = stage * T + tp_rank.

Every rank runs the same step (the typed step rank 0 broadcasts: backend/parallel/workers.py)
over the same block ids, decided by the one scheduler; a stage's KV cache has its own
layers only. Between stages the hidden state and the residual stream (vLLM's
IntermediateTensors) move by point-to-point send/recv from each rank to its peer (same
tp_rank) in the next stage; the last stage's logits go back to rank 0, where the
sampler runs. Each stage runs the steps in the order rank 0 launched them, so with
several micro-batches in flight (backend/engine/scheduling/batch_queue.py) a block one batch
writes and a later batch reuses is written by the later one last, on every stage.
Sends are asynchronous (a stage never waits for a busy next stage to take its hidden
state); rank 0 may defer the wait for a batch's logits (`defer_logits`).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from backend.models.config import ModelConfig
from backend.parallel.pending import PendingWorks

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers [start, end) of stage pp_rank (vLLM's rule: the remainder of an uneven
    split goes one layer each to the stages before the last, counting back)."""
    parts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        parts[-i] += 1
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]


def check_pipeline_parallel(cfg: ModelConfig, pp: int) -> Optional[str]:
    """Why this checkpoint cannot be split into pp stages, or None."""
    if pp == 1:
        return None
    if cfg.num_layers < pp:
        return f"{cfg.num_layers} layers cannot make {pp} stages"
    if cfg.moe is not None:
        return "mixture-of-experts models are not split into pipeline stages yet"
    if cfg.quantization is not None and cfg.quantization.get("quant_method") != "paged_llm_fp8":
        return "INT4/INT8 (GPTQ, AWQ, compressed-tensors) checkpoints run on one rank"
    return None


@dataclass(frozen=True)
class PipelineStage:
    """One rank's place in the pipeline."""
    rank: int                       # the stage, 0..size-1
    size: int                       # P
    start_layer: int
    end_layer: int
    tp_size: int = 1
    tp_rank: int = 0

    @classmethod
    def of(cls, world_rank: int, tp_size: int, pp_size: int, num_layers: int) -> "PipelineStage":
        stage = world_rank // tp_size
        return cls(stage, pp_size, *get_pp_indices(num_layers, stage, pp_size), tp_size, world_rank % tp_size)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def world_rank(self) -> int:
        return self.rank * self.tp_size + self.tp_rank

    def peer(self, stage: int) -> int:
        """The world rank of this rank's peer (same tp_rank) in another stage."""
        return stage * self.tp_size + self.tp_rank

    def owns(self, name: str, tied: bool) -> bool:
        """Whether this stage reads the checkpoint tensor `name`."""
        m = _LAYER.match(name)
        if m is not None:
            return self.start_layer <= int(m.group(1)) < self.end_layer
        if name.startswith("model.embed_tokens."):
            return self.is_first or (self.is_last and tied)
        if name.startswith(("model.norm.", "lm_head.")):
            return self.is_last
        return True

    # ------------------------------------------------------------ point to point
    def send_intermediate(self, hidden: torch.Tensor, residual: torch.Tensor, pending: PendingWorks) -> None:
        """To the next stage: the hidden state and the residual stream, as one tensor
        (asynchronously: the next stage may still be busy with an earlier batch)."""
        both = torch.stack([hidden, residual]).contiguous()
        pending.add(dist.isend(both, self.peer(self.rank + 1)), both)

    def recv_intermediate(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
                          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        both = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
        dist.recv(both, self.peer(self.rank - 1))
        return both[0], both[1]


def stage_kv_config(cfg: ModelConfig, stage: Optional[PipelineStage]) -> ModelConfig:
    """The KV cache shapes this stage allocates: its layers (with their FP8 K/V scales)."""
    if stage is None:
        return cfg
    quant = cfg.quantization
    if quant and quant.get("kv_cache_scales"):
        quant = {**quant, "kv_cache_scales": quant["kv_cache_scales"][stage.start_layer:stage.end_layer]}
    return dataclasses.replace(cfg, num_layers=stage.end_layer - stage.start_layer, quantization=quant)


class PPMissingLayer(nn.Identity):
    """vLLM's name: what stands where another stage's module would be (no weights)."""


def keep_stage(model: nn.Module, stage: PipelineStage) -> None:
    """Drop (before loading, on the meta device) the modules other stages hold. With tied
    embeddings the last stage's head keeps the parameter it was tied to, now its own."""
    layers = model.model.layers
    for i in range(len(layers)):
        if not stage.start_layer <= i < stage.end_layer:
            layers[i] = PPMissingLayer()
    if not stage.is_first:
        model.model.embed_tokens = PPMissingLayer()
    if not stage.is_last:
        model.model.norm = PPMissingLayer()
        model.lm_head = PPMissingLayer()


def stage_weights(state: dict[str, torch.Tensor], stage: PipelineStage, tied: bool) -> bool:
    """The last stage of a tied model reads the embedding as its head (in place). Returns
    whether the head stays tied to this rank's own embedding (one stage holds both)."""
    if tied and stage.is_last and not stage.is_first:
        state["lm_head.weight"] = state.pop("model.embed_tokens.weight")
        return False
    return tied and stage.is_first and stage.is_last


class PipelineStageModel(nn.Module):
    """A stage's part of the CausalLM, with the model's interface (`forward` over the
    packed step, `compute_logits`) so ModelRunner runs it unchanged:
    - forward: stage 0 embeds; the others receive the previous stage's hidden state and
      residual; each runs its layers; all but the last send theirs on and return an
      empty [T, 0] tensor (the runner's row selection applies to it at no cost); the
      last returns the normed hidden state.
    - compute_logits: the last stage computes them (gathered over its tensor-parallel
      ranks) and sends them to rank 0, which receives them; other ranks return None.
      With `defer_logits` (micro-batches in flight) rank 0 only posts the receive and
      returns the tensor it fills; `wait_logits` waits for the oldest one.
    `wait_s`: seconds this rank has spent waiting on another stage (for a hidden state,
    or rank 0 for logits): its share of the pipeline bubble."""

    def __init__(self, lm: nn.Module, stage: PipelineStage, dtype: torch.dtype) -> None:
        super().__init__()
        self.lm = lm
        self.stage = stage
        self.config = lm.config
        self.dtype = dtype
        self.defer_logits = False
        self.wait_s = 0.0
        self._sends = PendingWorks()
        self._logits_recvs: deque = deque()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta) -> torch.Tensor:
        lm, stage = self.lm, self.stage
        T = input_ids.shape[0]
        if stage.is_first:
            x, residual = lm.embed(input_ids), None
        else:
            start = time.perf_counter()
            x, residual = stage.recv_intermediate(T, self.config.hidden_size, self.dtype, input_ids.device)
            self.wait_s += time.perf_counter() - start
        for i in range(stage.start_layer, stage.end_layer):
            x, residual = lm.model.layers[i](x, residual, positions, lm.rotary_for(i),
                                             kv_caches[i - stage.start_layer], meta)
        if not stage.is_last:
            stage.send_intermediate(x, residual, self._sends)
            return x.new_empty(T, 0)
        norm = lm.model.norm
        return lm.ops.add_rms_norm(x, residual, norm.weight, norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        stage = self.stage
        if stage.is_last:
            logits = self.lm.compute_logits(hidden)
            if logits is None or stage.world_rank == 0:
                return logits
            dist.send(logits.contiguous(), 0)
            return None
        if stage.world_rank != 0:
            return None
        logits = torch.empty(hidden.shape[0], self.config.vocab_size, dtype=self.dtype, device=hidden.device)
        self._logits_recvs.append(dist.irecv(logits, self.peer_with_logits))
        if not self.defer_logits:
            self.wait_logits()
        return logits

    def wait_logits(self) -> None:
        """Rank 0: wait until the oldest launched step's logits have arrived (the last
        stage sends them in launch order)."""
        start = time.perf_counter()
        self._logits_recvs.popleft().wait()
        self.wait_s += time.perf_counter() - start

    @property
    def peer_with_logits(self) -> int:
        """The last stage's first tensor-parallel rank, where its logits are gathered."""
        return (self.stage.size - 1) * self.stage.tp_size
