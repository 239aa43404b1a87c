"""The tensor-parallel process group as the model sees it: which rank this is, and the
two collectives a Megatron-style layer needs (sum partial outputs, gather vocab shards).

Built on torch.distributed: NCCL between GPUs, gloo on CPU. With one rank every
collective is the identity, so the single-device model runs the same code with no cost.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's x, in place (the row-parallel layers' partial outputs)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Every rank's x concatenated along the last dimension on rank 0 (vocab-parallel
        logits go only where the sampler runs); None on the other ranks."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.is_first else None


SINGLE = TensorParallel()


def init_group(rank: int, size: int, init_method: str, device: torch.device, timeout_s: float) -> TensorParallel:
    """Join the ranks' process group. Collectives that wait longer than timeout_s on a
    rank that stopped answering raise instead of hanging the engine."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s),
                            **({"device_id": device} if device.type == "cuda" else {}))
    return TensorParallel(rank, size)


def control_group():
    """A gloo group for the step plans rank 0 sends (host buffers), beside the data
    group (NCCL on GPUs). It has no useful timeout: a worker waits in it for the next
    step for as long as the server is idle. A rank that dies closes its connections, and
    the others' waits fail at once."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
