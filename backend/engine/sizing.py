"""How big the engine is, decided once at load from its arguments and the device: the
device itself, whether the model splits over the ranks asked for, the KV pool in blocks,
max_model_len, and the step buffers' capacities. Errors name the engine argument.

The KV pool on CUDA (vLLM's rule): `gpu_memory_utilization` is a fraction of the device's
*total* memory, this engine's share. What was in use before the engine loaded anything
(other processes, other engines in this process, and this process's CUDA context, made
by the startup snapshot if not before) is not part of it: at startup the share only has
to be free (`check_startup_memory`), so that several engines share a device when their
fractions leave room for the contexts (0.45 + 0.45, not 0.5 + 0.5), as vLLM instances
do. From the share come off what the engine itself holds once the model is loaded
(weights, workspaces: the driver's in-use figure less the startup baseline), the peak
activation memory of a step measured by a
profile run at load (backend/engine/runner/profile_run.py: a prefill of max_num_batched_tokens
tokens and the sampler at max_num_seqs rows; with speculation, verification at
max_num_seqs x (k + 1) rows), the sampler's penalty tables at max_num_seqs rows (allocated
lazily, so reserved here), a draft model's proposal distributions held between steps, and
the decode CUDA graphs' pool (captured after the cache). What is left is the KV cache; nothing left is an error that
names gpu_memory_utilization. The arithmetic is `cuda_kv_budget`, a pure function."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.config import ConfigError, EngineArgs
from backend.engine.runner.cuda_graphs import graph_ladders, graph_pool_bytes, verify_query_len
from backend.engine.runner.step_inputs import GraphShape
from backend.models.config import ModelConfig
from backend.parallel.sharding import check_tensor_parallel

CPU_KV_CACHE_BYTES = 1 << 30
GIB = 1 << 30


@dataclass(frozen=True)
class MemoryProfile:
    """One device's memory as the profile run found it, in bytes."""
    total: int                  # the device's memory
    in_use: int                 # in use after loading and profiling (total - free): weights, CUDA
    #                             context, workspaces, other processes
    activation_peak: int        # the most a step allocated above what it started with
    profiled: bool = True       # False: activation_peak is an estimate (no profile run)
    baseline_in_use: int = 0    # in use before the engine loaded anything: not the engine's

    @property
    def engine_in_use(self) -> int:
        """What this engine holds after loading: weights, workspaces (not the CUDA context,
        made before the startup snapshot)."""
        return max(self.in_use - self.baseline_in_use, 0)


def check_startup_memory(free: int, total: int, gpu_memory_utilization: float) -> None:
    """vLLM's startup check: the engine's share of the device must be free before it loads
    anything (other processes and engines keep what they hold)."""
    share = int(total * gpu_memory_utilization)
    if free < share:
        raise ConfigError(
            f"invalid engine argument 'gpu_memory_utilization': {gpu_memory_utilization:g} x {total / GIB:.2f} GiB "
            f"total = {share / GIB:.2f} GiB requested, but {free / GIB:.2f} GiB is free at startup (other "
            "processes or engines on the device hold the rest); lower gpu_memory_utilization so that the "
            "engines sharing the device ask for at most what is free, or free the memory")


def penalty_table_bytes(max_num_seqs: int, vocab_size: int, initial_slots: int = 8) -> int:
    """The sampler's penalty tables (backend/engine/sampling/penalty_state.py) grown to serve
    max_num_seqs requests: bool `seen` and float32 `counts`, [slots + 1, V] each, the usable
    slots doubling from initial_slots."""
    slots = initial_slots
    while slots < max_num_seqs:
        slots *= 2
    return (slots + 1) * vocab_size * (1 + 4)


def draft_probs_bytes(speculative_config, max_num_seqs: int, vocab_size: int) -> int:
    """A draft model's proposal distributions, kept by each request from the step that
    proposes them to the step that verifies them (the rejection sampler needs q): fp32
    [k, V] per sampled request, at most max_num_seqs of them. n-gram proposals are point
    masses and keep nothing; nor does a tree (its acceptance needs no q)."""
    if speculative_config is None or speculative_config.method == "ngram" or speculative_config.token_tree:
        return 0
    return max_num_seqs * speculative_config.num_speculative_tokens * vocab_size * 4


def cuda_kv_budget(profile: MemoryProfile, gpu_memory_utilization: float, reserved: int = 0,
                   reserved_what: str = "") -> int:
    """KV cache bytes: total x gpu_memory_utilization - what the engine holds after loading
    - activation peak - reserved (penalty tables, CUDA graphs' pool). Refuses when nothing
    is left."""
    share = int(profile.total * gpu_memory_utilization)
    budget = share - profile.engine_in_use - profile.activation_peak - reserved
    if budget <= 0:
        peak = "peak activation memory" + ("" if profile.profiled else " (estimated)")
        raise ConfigError(
            f"invalid engine argument 'gpu_memory_utilization': {gpu_memory_utilization:g} x "
            f"{profile.total / GIB:.2f} GiB total = {share / GIB:.2f} GiB leaves nothing for the KV cache: "
            f"{profile.engine_in_use / GIB:.2f} GiB held by the engine after loading the model (weights, "
            f"workspaces), {profile.activation_peak / GIB:.2f} GiB {peak} of a step "
            f"(max_num_batched_tokens, max_num_seqs), {reserved / GIB:.2f} GiB reserved"
            f"{' (' + reserved_what + ')' if reserved_what else ''}; raise gpu_memory_utilization or lower "
            "max_num_batched_tokens / max_num_seqs")
    return budget


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
                       use_cuda_graphs: bool, bytes_per_block: int, profile: MemoryProfile | None = None,
                       num_samplers: int = 1, draft_cfg: ModelConfig | None = None,
                       encoder_cache_rows: int = 0) -> int:
    """KV blocks (per rank) from kv_cache_memory_bytes; else on CUDA from the profile
    (cuda_kv_budget: a share of total memory), less the penalty tables of num_samplers
    samplers (a draft model has its own), the draft's proposal distributions and the CUDA
    graphs' pools (the draft model's, `draft_cfg`, too) and a vision-language model's
    encoder cache (`encoder_cache_rows` of the decoder's width); else 1 GiB (CPU)."""
    budget = args.kv_cache_memory_bytes
    what = "kv_cache_memory_bytes"
    if budget is None and device.type == "cuda":
        if profile is None:
            raise ValueError("sizing the KV cache on CUDA needs a memory profile (backend/engine/runner/profile_run.py)")
        reserved = num_samplers * penalty_table_bytes(args.max_num_seqs, cfg.vocab_size)
        reserved_what = "the sampler's penalty tables"
        held = draft_probs_bytes(args.speculative_config, args.max_num_seqs, cfg.vocab_size)
        if held:
            reserved += held
            reserved_what += ", the draft's proposal distributions"
        if encoder_cache_rows:
            reserved += encoder_cache_rows * cfg.hidden_size * torch.tensor([], dtype=dtype).element_size()
            reserved_what += ", the encoder cache"
        if use_cuda_graphs:
            # The graphs' memory pool is captured after the cache is allocated.
            dtype_bytes = torch.tensor([], dtype=dtype).element_size()
            spec = args.speculative_config
            reserved += graph_pool_bytes(cfg, graph_shapes(args), dtype_bytes, captured_width(spec, cfg))
            reserved_what += " and the CUDA graphs' pool"
            if draft_cfg is not None:
                head = draft_cfg.hidden_size if spec.reads_target_hidden else 0     # (an EAGLE head's output)
                reserved += graph_pool_bytes(draft_cfg, draft_graph_shapes(args), dtype_bytes, head)
                reserved_what += "s (the target's and the draft model's)"
        budget = cuda_kv_budget(profile, args.gpu_memory_utilization, reserved, reserved_what)
        what = "gpu_memory_utilization"
    elif budget is None:
        budget = CPU_KV_CACHE_BYTES
    num = budget // bytes_per_block
    if num < 1:
        raise ConfigError(f"invalid engine argument '{what}': {budget} bytes for the KV cache "
                          f"hold no KV block ({bytes_per_block} bytes each)")
    return num


def captured_width(speculative_config, cfg: ModelConfig) -> int:
    """Channels per token the target's forward leaves for a drafter (CausalLM.captured_hidden):
    three layers' inputs for an EAGLE-3 head, the final hidden state for EAGLE-1 and Medusa."""
    if speculative_config is None or not speculative_config.reads_target_hidden:
        return 0
    return (3 if speculative_config.method == "eagle3" else 1) * cfg.hidden_size


def graph_shapes(args: EngineArgs) -> list[GraphShape]:
    """The CUDA graphs the engine captures: the decode ladder up to max_num_seqs rows, and
    under speculative decoding (without LoRA) the verify ladder of k + 1 tokens a row."""
    return graph_ladders(args.max_num_seqs, verify_query_len(args), input_sizes(args, 0)[0]).shapes


def draft_graph_shapes(args: EngineArgs) -> list[GraphShape]:
    """A draft model's CUDA graphs: its decode ladder, and its verify ladder over its step
    buffers (LoRA or not: the draft has none)."""
    return graph_ladders(args.max_num_seqs, draft_verify_query_len(args), draft_input_sizes(args, 0)[0]).shapes


def draft_verify_query_len(args: EngineArgs) -> int:
    """Tokens per row of a draft model's catch-up graphs: a verification's accepted
    tokens and the target's next, at most k + 1 (a tree's depth + 1)."""
    tree = args.speculative_config.token_tree
    return (tree.depth if tree is not None else args.speculative_config.num_speculative_tokens) + 1


def draft_input_sizes(args: EngineArgs, max_model_len: int) -> tuple[int, int, int]:
    """A draft model's step buffer capacities: its catch-up step can hold a target step's
    tokens and one more a sequence (the target's next token); a tree's level, a level's
    nodes a sequence."""
    tokens, seqs, blocks = input_sizes(args, max_model_len)
    tree = args.speculative_config.token_tree if args.speculative_config is not None else None
    widest = max(e - s for s, e in tree.levels) if tree is not None else 1
    return max(tokens + seqs, seqs * widest), seqs, blocks


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
