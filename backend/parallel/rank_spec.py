"""What the driver and its ranks share (the spec a rank starts from, the collectives'
time limit, the store keys, byte counts): apart from workers.py, which starts the ranks,
so that a rank (rank.py) imports it without importing its driver."""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Optional

import torch
import torch.distributed as dist

# Data-plane collectives (all-reduce, gather) that wait this long on a rank raise.
COLLECTIVE_TIMEOUT_S = 600.0


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a rank needs to build its shard (picklable: it crosses the spawn)."""
    model: str
    size: int                       # world size: tensor_parallel_size x pipeline_parallel_size
    device_type: str
    dtype: str                      # torch dtype name, e.g. "float32"
    kv_dtype: str
    attention_backend: str
    max_position: int
    rank: int = 0
    # With enable_lora: the engine arguments (model_dump()), from which each rank builds
    # its shard of the adapters.
    lora_engine_args: Optional[dict] = None
    enable_expert_parallel: bool = False
    kv_cache_scales: Optional[str] = None       # INT8 cache: the per-head scales file (kv_int8.py)
    pp_size: int = 1
    nnodes: int = 1                 # rank r runs on node r // ranks_per_node
    # The rendezvous store rank 0 serves (port 0: the OS picks, every rank on this machine).
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    join_timeout_s: float = 600.0
    node_health_timeout_s: float = 10.0

    @property
    def tp_size(self) -> int:
        return self.size // self.pp_size

    @property
    def ranks_per_node(self) -> int:
        return self.size // self.nnodes

    def device(self) -> torch.device:
        if self.device_type != "cuda":
            return torch.device("cpu")
        return torch.device("cuda", self.rank % self.ranks_per_node)

    def client_store(self) -> dist.TCPStore:
        """A connection to rank 0's rendezvous store (retried until join_timeout_s)."""
        return dist.TCPStore(self.master_addr, self.master_port, None, False,
                             datetime.timedelta(seconds=self.join_timeout_s))


def model_bytes(model: torch.nn.Module) -> int:
    from backend.models.cpu_packed_linear import packed_bytes
    return sum(p.numel() * p.element_size() for p in model.parameters()) + packed_bytes(model)


def kv_bytes(kv_caches) -> int:
    return sum(c.key.nbytes + c.value.nbytes for c in kv_caches)


def arrived_key(rank: int) -> str:
    """Set by each rank in the store before it joins the process group."""
    return f"paged_llm/rank{rank}/arrived"


def cpu_share(size: int) -> int:
    return max(1, (os.cpu_count() or 1) // size)


def agree(ok: bool, group) -> bool:
    """True on every rank if `ok` on every rank."""
    flag = torch.tensor([int(ok)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
