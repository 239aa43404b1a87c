"""How big the engine is, decided once at load from its arguments and the device: the
device itself, whether the model splits over the ranks asked for, the KV pool in blocks,
max_model_len, and the step buffers' capacities. Errors name the engine argument."""

from __future__ import annotations

import torch

from backend.config import ConfigError, EngineArgs
from backend.engine.cuda_graphs import estimate_graph_bytes
from backend.models.config import ModelConfig
from backend.parallel.sharding import check_tensor_parallel

CPU_KV_CACHE_BYTES = 1 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("invalid engine argument 'device': 'cuda' requested but no CUDA device is available")
    return torch.device(name)


def check_tensor_parallel_size(cfg: ModelConfig, tp_size: int, device: torch.device) -> None:
    problem = check_tensor_parallel(cfg, tp_size)
    if problem is None and tp_size > 1 and device.type == "cuda" and torch.cuda.device_count() < tp_size:
        problem = f"{torch.cuda.device_count()} CUDA devices are visible"
    if problem:
        raise ConfigError(f"invalid engine argument 'tensor_parallel_size': {tp_size} ({problem})")


def blocks_from_budget(args: EngineArgs, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                       use_cuda_graphs: bool, bytes_per_block: int) -> int:
    """KV blocks (per rank) from kv_cache_memory_bytes, or on CUDA from the free memory
    times gpu_memory_utilization less the CUDA graphs' pool; 1 GiB on CPU."""
    budget = args.kv_cache_memory_bytes
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * args.gpu_memory_utilization)
            if use_cuda_graphs:
                # The graphs' memory pool is captured after the cache is allocated.
                budget -= estimate_graph_bytes(cfg, args.max_num_seqs, torch.tensor([], dtype=dtype).element_size())
        else:
            budget = CPU_KV_CACHE_BYTES
    num = budget // bytes_per_block
    if num < 1:
        raise ConfigError(f"invalid engine argument 'kv_cache_memory_bytes': {budget} bytes "
                          f"hold no KV block ({bytes_per_block} bytes each)")
    return num


def resolve_max_model_len(args: EngineArgs, cfg: ModelConfig, num_kv_blocks: int) -> int:
    pool_tokens = num_kv_blocks * args.block_size
    if args.max_model_len is not None:
        if args.max_model_len > pool_tokens:
            raise ConfigError(
                f"invalid engine argument 'max_model_len': {args.max_model_len} tokens do not fit "
                f"the KV cache ({num_kv_blocks} blocks x {args.block_size} = {pool_tokens} tokens)")
        return args.max_model_len
    # One sequence must always fit the pool alone, or preemption could not save it.
    return min(cfg.max_position_embeddings, pool_tokens)


def input_sizes(args: EngineArgs, max_model_len: int) -> tuple[int, int, int]:
    """Step buffer capacities: tokens, sequences, blocks per sequence. A padded decode
    step has up to max_num_seqs tokens, whatever the token budget."""
    return (max(args.max_num_batched_tokens, args.max_num_seqs), args.max_num_seqs,
            -(-max_model_len // args.block_size))
