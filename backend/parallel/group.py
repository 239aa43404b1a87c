"""The tensor-parallel process group as the model sees it: which rank this is, and the
two collectives a Megatron-style layer needs (sum partial outputs, gather vocab shards).

Built on torch.distributed: NCCL between GPUs, gloo on CPU. With one rank every
collective is the identity, so the single-device model runs the same code with no cost.
Under pipeline parallelism (backend/parallel/pipeline.py) each stage's ranks form a group
of their own; world rank = stage * tp_size + tp_rank (vLLM's layout).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    # This stage's group under pipeline parallelism (None: the whole world), and its rank
    # 0 as a world rank (where the logits are gathered).
    group: Any = field(default=None, compare=False)
    first_rank: int = 0

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's x, in place (the row-parallel layers' partial outputs)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Every rank's x concatenated along the last dimension on rank 0 (vocab-parallel
        logits go only where the sampler runs); None on the other ranks."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        dist.gather(x, parts, dst=self.first_rank, group=self.group)
        return torch.cat(parts, dim=-1) if self.is_first else None


SINGLE = TensorParallel()


def init_group(rank: int, size: int, store: dist.Store, device: torch.device, timeout_s: float,
               tp_size: Optional[int] = None) -> TensorParallel:
    """Join the ranks' process group through the rendezvous store, and with several
    pipeline stages (tp_size < size) make each stage's group (every rank makes every
    group, in the same order). Collectives that wait longer than timeout_s on a rank that
    stopped answering raise instead of hanging the engine."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout,
                            **({"device_id": device} if device.type == "cuda" else {}))
    tp_size = tp_size or size
    if tp_size == size:
        return TensorParallel(rank, size)
    if tp_size == 1:
        return TensorParallel()
    mine = None
    for first in range(0, size, tp_size):
        group = dist.new_group(list(range(first, first + tp_size)), timeout=timeout)
        if first <= rank < first + tp_size:
            mine = group
    return TensorParallel(rank % tp_size, tp_size, mine, rank - rank % tp_size)


def control_group():
    """A gloo group for the control messages and steps rank 0 sends, beside the data
    group (NCCL on GPUs). It has no useful timeout: a worker waits in it for the next
    step for as long as the server is idle. A rank that dies closes its connections, and
    the others' waits fail at once."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
