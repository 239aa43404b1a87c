"""The composition root: the engine's parts built from the validated EngineArgs, each
handed what it needs when it is constructed.

One function reads the configuration and builds, in dependency order: the model config
and device, the tensor-parallel ranks, the model (with LoRA and a draft model), the KV
cache's size and its manager, the speculator, the scheduler, the KV cache tensors, the
runner, and last the CUDA graphs (a capture runs the runner's own forward). LLMEngine
(llm_engine.py) runs steps over these parts and builds nothing itself.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch

from backend.attention import make_attention_factory, resolve_attention_backend
from backend.config import ConfigError, EngineArgs
from backend.engine import sizing
from backend.engine.runner import profile_run
from backend.engine.runner import cpu_shards, cpu_threads
from backend.engine.runner.cpu_shards import ShardedForward, sharded_forward
from backend.engine.runner.cpu_threads import StepThreads, intra_op_threads, step_threads
from backend.engine.runner.cuda_graphs import verify_query_len
from backend.engine.host_malloc import keep_large_blocks
from backend.engine.kv_events.collector import KVEventCollector
from backend.engine.scheduling.kv_handoff import KVHandoff
from backend.engine.kv_offload.host_cache import HostKVCache
from backend.engine.kv_offload.host_tier import HostOffloadScheduler, num_host_slots
from backend.engine.scheduling.kv_cache_manager import KVCacheManager
from backend.engine.scheduling.priority import Ranking
from backend.engine.runner.kv_int8 import kv_cache_torch_dtype, load_kv_cache_scales, set_kv_cache_scales
from backend.engine.runner.model_runner import ModelRunner, allocate_kv_cache, kv_cache_bytes_per_block
from backend.engine.runner.pooling_runner import PoolingModelRunner
from backend.engine.sampling.sampler import Sampler
from backend.engine.scheduling.scheduler import Scheduler
from backend.engine.spec_decode.speculator import Speculator, load_drafter, make_proposer
from backend.engine.runner.mm_step import EncoderOutputs
from backend.engine.runner.step_inputs import StepInputBuilder
from backend.engine.vision import VisionParts, make_vision
from backend.engine.structured_output.structured_output_manager import StructuredOutputManager
from backend.lora import make_lora_manager
from backend.models.config import ModelConfig, load_model_config
from backend.models.cpu_packed_linear import own_remaining_weights, pack_cpu_linears
from backend.models.int_linear import prepare_kernel_layouts
from backend.models.loader import load_model, load_tokenizer
from backend.models.rotary import long_rope
from backend.ops import make_layer_ops
from backend.parallel.group import SINGLE
from backend.parallel.moe_sharding import with_expert_parallel
from backend.parallel.pipeline import stage_kv_config
from backend.parallel.rank_spec import kv_bytes, model_bytes
from backend.parallel.sharding import kv_head_range, local_config
from backend.parallel.workers import TensorParallelWorkers, check_world, worker_spec

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineParts:
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    attention_backend: str
    max_position: int
    long_rope_original: Optional[int]
    workers: Optional[TensorParallelWorkers]
    model: Optional[torch.nn.Module]
    lora: object
    tokenizer: object
    use_cuda_graphs: bool
    memory_profile: Optional[sizing.MemoryProfile]
    num_kv_blocks: int
    max_model_len: int
    kv_cache_bytes: int
    kv_cache: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    speculator: Optional[Speculator]
    bytes_per_rank: list[tuple[int, int]]       # (weight bytes, KV cache bytes) of each rank, rank 0 first
    kv_events: Optional[KVEventCollector] = None    # KV cache events, with kv_events_config
    handoff: Optional[KVHandoff] = None         # blocks handed between engines (disaggregation)
    vision: Optional[VisionParts] = None        # vision-language models: processor, limits, encoder cache


def assemble(args: EngineArgs) -> EngineParts:
    """The engine's parts; on a failure, the tensor-parallel ranks and shard threads
    already started are stopped before the error goes on."""
    started: list = []
    try:
        return _assemble(args, started)
    except BaseException:
        for part in started:        # the ranks first, then the shard threads
            try:
                part.close() if isinstance(part, ShardedForward) else part.shutdown()
            except Exception:       # the build's own error is the one to raise
                logger.exception("stopping %s after a failed engine build", type(part).__name__)
        raise


def _assemble(args: EngineArgs, started: list) -> EngineParts:
    cfg = with_expert_parallel(load_model_config(args.model), args.enable_expert_parallel)
    # The onnxruntime runner is a CPU reference: "auto" means the CPU there, GPU or not.
    device = sizing.resolve_device("cpu" if args.model_runner == "onnxruntime" else args.device)
    tp_size = args.tensor_parallel_size
    vision = make_vision(args, cfg)        # (refuses what images cannot run with, before the model loads)
    sizing.check_tensor_parallel_size(cfg, tp_size, device)
    check_world(cfg, args, device)
    if args.world_size > 1 and device.type == "cuda":
        device = torch.device("cuda", 0)        # rank r runs on cuda:r
    dtype = _DTYPES[cfg.torch_dtype if args.dtype == "auto" and cfg.torch_dtype in _DTYPES
                    else ("float32" if args.dtype == "auto" else args.dtype)]
    attention_backend = resolve_attention_backend(args.attention_backend, device)
    kv_dtype = kv_cache_torch_dtype(args.kv_cache_dtype, dtype)
    # INT8 cache: rank 0's share of the per-head scales, read (and checked) before the model.
    kv_scales = (load_kv_cache_scales(args.kv_cache_scales, cfg, kv_head_range(cfg, 0, tp_size))
                 if args.kv_cache_scales else None)
    startup = None                  # (free, total) on CUDA before anything of this engine is loaded
    if args.num_kv_blocks is None and args.kv_cache_memory_bytes is None and device.type == "cuda":
        startup = profile_run.startup_snapshot(device)
        sizing.check_startup_memory(*startup, args.gpu_memory_utilization)

    if device.type == "cpu":
        keep_large_blocks()         # a CPU forward's activations reused, not mapped anew (host_malloc.py)
    if args.model_runner == "onnxruntime":
        dtype = torch.float32       # the reference export is fp32
        kv_dtype = torch.float32
    if args.model_runner == "tensorrt" and device.type != "cuda":
        raise ConfigError("invalid engine argument 'model_runner': 'tensorrt' needs a CUDA device")
    max_position = max(cfg.max_position_embeddings, args.max_model_len or 0)
    # LongRoPE: original_max_position_embeddings, past which a request runs in long mode.
    long_rope_original = long_rope(cfg.rope_scaling)
    workers = None
    if args.world_size > 1:
        workers = TensorParallelWorkers(worker_spec(args, device, dtype, kv_dtype, attention_backend, max_position),
                                        cfg.num_layers)
        started.append(workers)
    stage = workers.stage if workers else None      # pipeline parallelism: rank 0's stage
    model = None
    if args.model_runner == "torch":
        model = load_weights(args, cfg, dtype, device, attention_backend, max_position, workers, stage)
    lora = make_lora_manager(args, cfg, model, device, dtype, attention_backend, tp_size=tp_size)
    if model is not None:
        pack_weights(model, device, dtype, workers)
    if device.type == "cpu":
        load_cpu_kernels()
    tokenizer = load_tokenizer(args.model)
    spec = args.speculative_config
    if spec is not None and spec.token_tree is not None and any(cfg.sliding_windows):
        # (a node's window would follow its place in the sequence, not its rotary position)
        raise ConfigError("invalid engine argument 'speculative_config.speculative_token_tree': not with a model "
                          "whose layers attend through a sliding window")
    # (the drafter network, the config of its K/V in the target's blocks or None), or None
    draft = load_drafter(spec, model, stage, tokenizer, cfg.vocab_size, dtype, device, attention_backend,
                         max_position) if spec is not None else None
    draft_cfg = draft[1] if draft is not None else None

    use_cuda_graphs = (device.type == "cuda" and attention_backend == "triton" and args.model_runner == "torch"
                       and not args.enforce_eager
                       and args.runner == "generate"        # (pooling runs no decode step)
                       and stage is None)
    # Per rank: each holds its KV heads of every block (and budgets are per device).
    rank_cfg = stage_kv_config(local_config(cfg, tp_size), stage)
    bytes_per_block = kv_cache_bytes_per_block(rank_cfg, args.block_size, kv_dtype)
    if draft_cfg is not None:       # the draft's K/V lives in the same blocks
        bytes_per_block += kv_cache_bytes_per_block(draft_cfg, args.block_size, kv_dtype)
    memory_profile = None
    if startup is not None:         # sized from gpu_memory_utilization
        memory_profile = dataclasses.replace(measure_memory(model, workers, cfg, args, dtype, kv_dtype, device),
                                             baseline_in_use=startup[1] - startup[0])
    num_kv_blocks = args.num_kv_blocks or sizing.blocks_from_budget(
        args, cfg, device, dtype, use_cuda_graphs, bytes_per_block, memory_profile,
        num_samplers=1 if spec is None or spec.method == "ngram" else 2,     # (a drafter draws with its own)
        draft_cfg=draft_cfg, encoder_cache_rows=vision.encoder_cache.cache_size if vision is not None else 0)
    max_model_len = sizing.resolve_max_model_len(args, cfg, num_kv_blocks)

    # Every layer sliding (Mistral-style): blocks out of every window are freed during
    # generation. Not with speculation (a draft shares the blocks; rejected tokens
    # roll back) nor for mixed layers (Gemma: the full layers need every block).
    windows = cfg.sliding_windows
    window = max(windows) if windows and all(windows) and spec is None else None
    # MEAN pooling needs every prompt token computed (pooling_runner.py): no prefix cache.
    prefix_caching = args.enable_prefix_caching and not (
        args.runner == "pooling" and args.pooler.pooling_type == "MEAN")
    kv_events = _kv_events(args)
    if kv_events is not None:
        started.append(kv_events)
    host_tier = None
    if args.kv_offloading_size is not None:     # the host tier's index (kv_offload/host_tier.py)
        host_tier = HostOffloadScheduler(num_host_slots(args.kv_offloading_size, bytes_per_block), args.block_size,
                                         events=kv_events)
    kv_cache = KVCacheManager(num_kv_blocks, args.block_size, prefix_caching, window, connector=host_tier,
                              events=kv_events)

    speculator, draft_layers = None, None
    if spec is not None:
        draft_layers = (allocate_kv_cache(draft_cfg, num_kv_blocks, args.block_size, kv_dtype, device)
                        if draft_cfg is not None else None)
        tokens, seqs, blocks = sizing.draft_input_sizes(args, max_model_len)
        # The draft builds and draws k times a step: k host staging buffers each, so
        # none waits for the device to have read the one before (buffers.py).
        slots = spec.num_speculative_tokens if spec.method != "ngram" else 1
        speculator = Speculator(spec, make_proposer(
            spec, draft, args.block_size, draft_layers,
            StepInputBuilder(tokens, seqs, blocks, args.block_size, device, staging_slots=slots),
            Sampler(args.seed + 1, device, args.max_num_seqs, staging_slots=slots), cfg.vocab_size))
    drafter = speculator.proposer if speculator is not None and speculator.in_runner else None
    # Blocks handed to or from another engine hold the target's K/V of one rank: not with
    # a draft model's own cache beside it, nor with the cache split across ranks; not
    # with sliding windows (a long prompt's leading blocks go back to the pool while it
    # runs), nor LongRoPE (a long prompt's blocks are salted for the long frequencies).
    # Nor beside the host tier, whose copies of a block run on a stream of their own.
    handoff = KVHandoff(kv_cache) if prefix_caching and draft_layers is None and window is None and \
        long_rope_original is None and host_tier is None and args.tensor_parallel_size == 1 and \
        args.pipeline_parallel_size == 1 else None

    scheduler = Scheduler(kv_cache, args.max_num_seqs, args.max_num_batched_tokens,
                          max_loras=args.max_loras if lora is not None else None,
                          structured=StructuredOutputManager(tokenizer, cfg.vocab_size, device, args.max_num_seqs,
                                                             args.guided_compile_timeout_s),
                          long_rope_original=long_rope_original,
                          may_speculate=Speculator.can_speculate if speculator is not None else None,
                          # the draft proposes inside the runner's step, into slots reserved with it
                          num_lookahead_tokens=spec.num_speculative_tokens if drafter is not None else 0,
                          policy=args.scheduling_policy, ranking=Ranking(args.priority_aging_s), handoff=handoff,
                          encoder=vision.encoder_cache if vision is not None else None,
                          lower_priority_prefill_tokens=args.lower_priority_prefill_tokens)
    kv_layers = allocate_kv_cache(rank_cfg, num_kv_blocks, args.block_size, kv_dtype, device)
    if kv_scales is not None:
        set_kv_cache_scales(kv_layers, kv_scales)
    weight_bytes = model_bytes(model) if model is not None else 0
    shards = _cpu_shards(args, cfg, device, attention_backend, workers, lora, weight_bytes, vision is not None)
    if shards is not None:
        started.append(shards)
    runner = _make_runner(args, cfg, model, kv_layers, device, max_model_len, max_position,
                          long_rope_original, vision is not None and vision.processor.whole_images, workers=workers,
                          lora=lora, shards=shards, drafter=drafter,
                          threads=_step_threads(args, cfg, device, attention_backend, workers, shards, weight_bytes),
                          kv_connector=HostKVCache(kv_layers, host_tier.index.num_slots) if host_tier else None,
                          encoder_outputs=EncoderOutputs(model, device, dtype) if vision is not None else None,
                          tree=spec.token_tree if spec is not None else None)
    bytes_per_rank = [(weight_bytes, kv_bytes(kv_layers))]
    if workers is not None:
        bytes_per_rank = workers.setup(num_kv_blocks, args.block_size, sizing.input_sizes(args, max_model_len),
                                       *bytes_per_rank[0])
    if use_cuda_graphs:
        runner.capture_graphs(args.max_num_seqs, max_model_len, verify_query_len(args))
        if drafter is not None:
            drafter.capture_graphs(args.max_num_seqs, max_model_len, sizing.draft_verify_query_len(args))
    kv_cache_bytes = num_kv_blocks * bytes_per_block       # (a drafter's K/V included: bytes_per_block)
    return EngineParts(
        model_config=cfg, device=device, dtype=dtype, attention_backend=attention_backend,
        max_position=max_position, long_rope_original=long_rope_original, workers=workers, model=model,
        lora=lora, tokenizer=tokenizer, use_cuda_graphs=use_cuda_graphs, memory_profile=memory_profile,
        num_kv_blocks=num_kv_blocks, max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes,
        kv_cache=kv_cache, scheduler=scheduler, runner=runner, speculator=speculator,
        bytes_per_rank=bytes_per_rank, kv_events=kv_events, handoff=handoff, vision=vision)


def _kv_events(args: EngineArgs) -> Optional[KVEventCollector]:
    """vLLM's kv_events_config: the engine thread's collector and its ZMQ publisher."""
    cfg = args.kv_events_config
    if cfg is None or not cfg.enable_kv_cache_events or cfg.publisher == "null":
        return None
    from backend.engine.kv_events.publisher import ZmqEventPublisher
    return KVEventCollector(args.block_size, ZmqEventPublisher(
        cfg.endpoint, cfg.topic, args.block_size, cfg.hwm, cfg.max_queue_size, cfg.replay_endpoint,
        cfg.buffer_steps, int_hashes=cfg.block_hash_format == "int"))


def load_weights(args: EngineArgs, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, attention_backend: str,
                 max_position: int, workers=None, stage=None):
    """The torch model with the checkpoint's weights (sleep_mode.py reads them again this way)."""
    return load_model(args.model, cfg, dtype, device, make_attention_factory(attention_backend), max_position,
                      make_layer_ops(attention_backend), workers.tp if workers else SINGLE,
                      int_kernel=attention_backend == "triton", pooling=args.runner == "pooling", stage=stage)


def load_cpu_kernels() -> None:
    """Our C++ kernels built (or read from their cache) while the engine loads, not in its
    first step, where a compile of seconds would trip the stall watchdog."""
    from backend.attention import cpu_decode  # noqa: F401  (each module defines its library)
    from backend.ops import cpu_argmax, cpu_build, cpu_layer_ops  # noqa: F401
    cpu_build.load_all()


def pack_weights(model, device: torch.device, dtype: torch.dtype, workers=None) -> None:
    """One rank's fp32 CPU projections as oneDNN's pre-packed weights
    (backend/models/cpu_packed_linear.py), after LoRA wrapped them; INT weights in their
    Triton kernel's layout."""
    prepare_kernel_layouts(model)
    if device.type == "cpu" and dtype == torch.float32 and not workers:
        if pack_cpu_linears(model):
            own_remaining_weights(model)    # so the checkpoint file's mapping can go


def measure_memory(model, workers, cfg: ModelConfig, args: EngineArgs, dtype: torch.dtype,
                    kv_dtype: torch.dtype, device: torch.device) -> sizing.MemoryProfile:
    """CUDA, before the KV cache: the profile run (backend/engine/runner/profile_run.py) where
    this rank can run a step alone; under tensor parallelism (each rank's forward needs
    the others) or with an exported-graph runner, the driver's figures on rank 0's
    device and an estimated activation peak."""
    if model is not None and workers is None:
        return profile_run.profile_memory(model, args, kv_dtype, device, cfg.vocab_size)
    dtype_bytes = torch.tensor([], dtype=dtype).element_size()
    return profile_run.estimated_profile(cfg, args, dtype_bytes, device)


def _make_runner(args: EngineArgs, cfg: ModelConfig, model, kv_layers, device: torch.device,
                 max_model_len: int, max_position: int,
                 long_rope_original: Optional[int], image_attention: bool = False, tree=None,
                 **parts) -> ModelRunner:
    """The runner args.runner and args.model_runner name. `parts`: workers, lora,
    shards and drafter, for the torch model's runner; the others take none of them (no
    ranks, adapters, shards or draft)."""
    sampler = Sampler(args.seed, device, args.max_num_seqs)
    inputs = StepInputBuilder(*sizing.input_sizes(args, max_model_len), args.block_size, device,
                              long_rope=(long_rope_original, max_position) if long_rope_original is not None else None,
                              mrope=getattr(model, "uses_mrope", False), image_attention=image_attention, tree=tree)
    common = (kv_layers, args.block_size, device, sampler, inputs, cfg.vocab_size)
    if args.runner == "pooling":
        return PoolingModelRunner(model, *common, pooler=args.pooler)
    if args.model_runner == "torch":
        return ModelRunner(model, *common, tree=tree, **parts)
    from backend.engine.runner.graph_runner import GraphModelRunner, OnnxRuntimeGraph, TensorRTGraph
    if not os.path.isfile(args.model_graph):
        raise ConfigError(f"invalid engine argument 'model_graph': no file at '{args.model_graph}'")
    try:
        graph = (OnnxRuntimeGraph(args.model_graph, cfg.num_layers, args.block_size)
                 if args.model_runner == "onnxruntime" else TensorRTGraph(args.model_graph, device))
    except ImportError as e:
        raise ConfigError(f"invalid engine argument 'model_runner': '{args.model_runner}' needs a package "
                          f"that is not installed ({e})") from None
    return GraphModelRunner(graph, *common)


def _step_threads(args: EngineArgs, cfg: ModelConfig, device: torch.device, attention_backend: str, workers,
                  shards: Optional[ShardedForward], weight_bytes: int) -> Optional[StepThreads]:
    """The engine thread's intra-op threads per step (cpu_threads.py): the torch model on
    CPU on one rank, its weights in the last-level cache; a step worth less than two
    shards runs with one thread, the rest with one shard's share (when the forward is
    split) or all."""
    eligible = (args.model_runner == "torch" and device.type == "cpu" and attention_backend == "torch"
                and workers is None)
    busy = shards.threads_per_shard if shards is not None else intra_op_threads()
    # (read through the module: tests set the minimum there)
    return step_threads(eligible, busy, cfg.hidden_size, cfg.num_layers,
                        weight_bytes <= cpu_shards.last_level_cache_bytes(), cpu_threads.MIN_SHARED_STEP_WORK)


def _cpu_shards(args: EngineArgs, cfg: ModelConfig, device: torch.device, attention_backend: str, workers, lora,
                weight_bytes: int, vision: bool = False) -> Optional[ShardedForward]:
    """The forward split by sequences over threads (cpu_shards.py): only the torch
    model's eager path on CPU, on one rank, without LoRA (its row groups are the whole
    step's); by default only where the weights fit in the last-level cache."""
    heads = args.speculative_config is not None and args.speculative_config.reads_target_hidden
    eligible = (args.runner == "generate" and args.model_runner == "torch" and device.type == "cpu"
                and attention_backend == "torch" and workers is None and lora is None
                and not heads           # (EAGLE and Medusa heads read the whole step's hidden states)
                and not vision)         # (a step's image rows and M-RoPE table are the whole step's)
    requested = args.cpu_forward_shards
    if requested is not None and requested > 1 and not eligible:
        raise ConfigError(f"invalid engine argument 'cpu_forward_shards': {requested} shards need the torch "
                          "model on CPU with attention_backend 'torch', one rank, no LoRA, no EAGLE or Medusa heads, no images and runner "
                          "'generate'; leave it unset")
    return sharded_forward(requested, eligible, cfg.hidden_size, cfg.num_layers, weight_bytes)
