"""The engine: requests in, one scheduled step at a time, outputs out.

Data flows one way: add_request (intake.py) -> Scheduler.schedule -> ModelRunner launch,
sample, collect (model and sampler, or the rejection sampler when proposals are
verified; with async scheduling the host schedules step N+1 while the device runs step
N: core_step) -> ModelRunnerOutput ->
Scheduler.update_from_output (the one writer of request and KV state: tokens appended,
stops on token ids, requests finished; with runner="pooling", PoolingModelRunner returns
pooled hidden states instead and a request finishes when its prompt is computed)
-> EngineCoreOutput; with speculative decoding a draft model proposes the next step's
tokens inside the runner's step (into lookahead slots reserved with the step) and a
lookup after the update; the scheduler keeps them.
`core_step` ends there; the output side (OutputProcessor: text, stop strings, logprob
text) turns core outputs into RequestOutputs, inline in `step` or on its own thread
(engine_loop.py), and a stop string comes back as one call (`stop_requests`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from typing import Callable, Optional

import torch

from backend.config import ConfigError, EngineArgs
from backend.engine import profile_run, sizing
from backend.engine.batch_queue import BatchQueue
from backend.engine.cpu_shards import ShardedForward, sharded_forward
from backend.engine.kv_cache_manager import KVCacheManager
from backend.engine.kv_int8 import kv_cache_torch_dtype, load_kv_cache_scales, set_kv_cache_scales
from backend.engine.cuda_graphs import capture_decode_graphs, verify_query_len
from backend.engine.deadlines import Deadlines
from backend.engine.gc_policy import freeze_heap
from backend.engine.host_malloc import keep_large_blocks
from backend.engine.intake import Prompt, RequestIntake  # noqa: F401 (Prompt: part of this module's API)
from backend.engine.model_runner import LaunchedStep, ModelRunner, allocate_kv_cache, kv_cache_bytes_per_block
from backend.engine.output_processor import OutputProcessor
from backend.engine.pooling_runner import PoolingModelRunner
from backend.engine.outputs import EngineCoreOutput, ModelRunnerOutput, RequestOutput
from backend.engine.request import Request
from backend.engine.request_limits import RequestLimits
from backend.engine.sampler import Sampler
from backend.engine.scheduler import Scheduler
from backend.engine.spec_decode.draft_model import load_draft
from backend.engine.spec_decode.speculator import Speculator, make_proposer
from backend.engine.step_inputs import StepInputBuilder
from backend.engine.structured_output_manager import StructuredOutputManager
from backend.lora import make_lora_manager
from backend.models.config import ModelConfig, load_model_config
from backend.models.cpu_packed_linear import own_remaining_weights, pack_cpu_linears
from backend.models.loader import load_model, load_tokenizer
from backend.models.rotary import long_rope
from backend.attention import make_attention_factory, resolve_attention_backend
from backend.ops import make_layer_ops
from backend.parallel.group import SINGLE
from backend.parallel.moe_sharding import with_expert_parallel
from backend.parallel.sharding import kv_head_range, local_config
from backend.parallel.pipeline import stage_kv_config
from backend.parallel.rank_spec import kv_bytes, model_bytes
from backend.parallel.workers import TensorParallelWorkers, check_world, worker_spec

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}



class LLMEngine(RequestIntake):
    def __init__(self, args: EngineArgs) -> None:
        self.workers: Optional[TensorParallelWorkers] = None
        try:
            self._build(args)
        except BaseException:
            self.shutdown()         # tensor-parallel ranks already started
            raise

    def _build(self, args: EngineArgs) -> None:
        self.args = args
        self.model_config: ModelConfig = with_expert_parallel(load_model_config(args.model),
                                                              args.enable_expert_parallel)
        cfg = self.model_config
        # The onnxruntime runner is a CPU reference: "auto" means the CPU there, GPU or not.
        self.device = sizing.resolve_device("cpu" if args.model_runner == "onnxruntime" else args.device)
        tp_size = args.tensor_parallel_size
        sizing.check_tensor_parallel_size(cfg, tp_size, self.device)
        check_world(cfg, args, self.device)
        if args.world_size > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", 0)   # rank r runs on cuda:r
        self.dtype = _DTYPES[cfg.torch_dtype if args.dtype == "auto" and cfg.torch_dtype in _DTYPES
                             else ("float32" if args.dtype == "auto" else args.dtype)]
        self.attention_backend = resolve_attention_backend(args.attention_backend, self.device)
        kv_dtype = kv_cache_torch_dtype(args.kv_cache_dtype, self.dtype)
        # INT8 cache: rank 0's share of the per-head scales, read (and checked) before the model.
        kv_scales = (load_kv_cache_scales(args.kv_cache_scales, cfg, kv_head_range(cfg, 0, tp_size))
                     if args.kv_cache_scales else None)
        startup = None              # (free, total) on CUDA before anything of this engine is loaded
        if args.num_kv_blocks is None and args.kv_cache_memory_bytes is None and self.device.type == "cuda":
            startup = profile_run.startup_snapshot(self.device)
            sizing.check_startup_memory(*startup, args.gpu_memory_utilization)

        if self.device.type == "cpu":
            keep_large_blocks()         # a CPU forward's activations reused, not mapped anew (host_malloc.py)
        if args.model_runner == "onnxruntime":
            self.dtype = torch.float32      # the reference export is fp32
            kv_dtype = torch.float32
        if args.model_runner == "tensorrt" and self.device.type != "cuda":
            raise ConfigError("invalid engine argument 'model_runner': 'tensorrt' needs a CUDA device")
        max_position = self.max_position = max(cfg.max_position_embeddings, args.max_model_len or 0)
        # LongRoPE: original_max_position_embeddings, past which a request runs in long mode.
        self.long_rope_original = long_rope(cfg.rope_scaling)
        if args.world_size > 1:
            self.workers = TensorParallelWorkers(worker_spec(args, self.device, self.dtype, kv_dtype,
                                                             self.attention_backend, max_position), cfg.num_layers)
        stage = self.workers.stage if self.workers else None        # pipeline parallelism: rank 0's stage
        self.model = None
        if args.model_runner == "torch":
            self.model = load_model(args.model, cfg, self.dtype, self.device,
                                    make_attention_factory(self.attention_backend), max_position,
                                    make_layer_ops(self.attention_backend),
                                    self.workers.tp if self.workers else SINGLE,
                                    int_kernel=self.attention_backend == "triton", pooling=args.runner == "pooling",
                                    stage=stage)
        self.lora = make_lora_manager(args, cfg, self.model, self.device, self.dtype, self.attention_backend,
                                      tp_size=tp_size)
        if self.model is not None and self.device.type == "cpu" and self.dtype == torch.float32 and not self.workers:
            # oneDNN's pre-packed weights for the fp32 projections (backend/models/cpu_packed_linear.py).
            if pack_cpu_linears(self.model):
                own_remaining_weights(self.model)   # so the checkpoint file's mapping can go
        self.tokenizer = load_tokenizer(args.model)
        spec = args.speculative_config
        draft = None
        if spec is not None and spec.method == "draft_model":
            draft = load_draft(spec.model, cfg.vocab_size, self.tokenizer, self.dtype, self.device,
                               self.attention_backend, max_position)

        self.use_cuda_graphs = (self.device.type == "cuda" and self.attention_backend == "triton"
                                and args.model_runner == "torch" and not args.enforce_eager
                                and args.runner == "generate"      # (pooling runs no decode step)
                                and stage is None)
        # Per rank: each holds its KV heads of every block (and budgets are per device).
        rank_cfg = stage_kv_config(local_config(cfg, tp_size), stage)
        bytes_per_block = kv_cache_bytes_per_block(rank_cfg, args.block_size, kv_dtype)
        if draft is not None:           # the draft's K/V lives in the same blocks
            bytes_per_block += kv_cache_bytes_per_block(draft[1], args.block_size, kv_dtype)
        self.memory_profile: Optional[sizing.MemoryProfile] = None
        if startup is not None:         # sized from gpu_memory_utilization
            self.memory_profile = dataclasses.replace(self._profile_memory(kv_dtype),
                                                      baseline_in_use=startup[1] - startup[0])
        self.num_kv_blocks = args.num_kv_blocks or sizing.blocks_from_budget(
            args, cfg, self.device, self.dtype, self.use_cuda_graphs, bytes_per_block, self.memory_profile,
            num_samplers=1 if draft is None else 2, draft_cfg=draft[1] if draft is not None else None)
        self.max_model_len = sizing.resolve_max_model_len(args, cfg, self.num_kv_blocks)
        self.kv_cache_bytes = self.num_kv_blocks * bytes_per_block

        # Every layer sliding (Mistral-style): blocks out of every window are freed during
        # generation. Not with speculation (a draft shares the blocks; rejected tokens
        # roll back) nor for mixed layers (Gemma: the full layers need every block).
        windows = cfg.sliding_windows
        window = max(windows) if windows and all(windows) and spec is None else None
        # MEAN pooling needs every prompt token computed (pooling_runner.py): no prefix cache.
        prefix_caching = args.enable_prefix_caching and not (
            args.runner == "pooling" and args.pooler.pooling_type == "MEAN")
        self.kv_cache = KVCacheManager(self.num_kv_blocks, args.block_size, prefix_caching, window)
        self.scheduler = Scheduler(self.kv_cache, args.max_num_seqs, args.max_num_batched_tokens,
                                   max_loras=args.max_loras if self.lora is not None else None,
                                   structured=StructuredOutputManager(
                                       self.tokenizer, cfg.vocab_size, self.device, args.max_num_seqs,
                                       args.guided_compile_timeout_s))
        self.scheduler.long_rope_original = self.long_rope_original
        kv_layers = allocate_kv_cache(rank_cfg, self.num_kv_blocks, args.block_size, kv_dtype, self.device)
        if kv_scales is not None:
            set_kv_cache_scales(kv_layers, kv_scales)
        self.runner = self._make_runner(kv_layers)
        self.runner.structured = self.scheduler.structured
        # (weight bytes, KV cache bytes) of each rank, rank 0 first.
        self.bytes_per_rank = [(model_bytes(self.model) if self.model is not None else 0, kv_bytes(kv_layers))]
        self.runner.shards = self._cpu_shards()
        if self.workers is not None:
            self.bytes_per_rank = self.workers.setup(
                self.num_kv_blocks, args.block_size, sizing.input_sizes(self.args, self.max_model_len),
                *self.bytes_per_rank[0])
        if self.use_cuda_graphs:
            verify_len = verify_query_len(args)     # the verify steps' ladder, if any
            capture = lambda: capture_decode_graphs(self.runner, args.max_num_seqs, self.max_model_len,  # noqa: E731
                                                    verify_len)
            self.runner.graphs = (capture() if self.workers is None else self.workers.capture_graphs(
                capture, args.max_num_seqs, self.max_model_len, verify_len))
        self.speculator: Optional[Speculator] = None
        if spec is not None:
            draft_layers = (allocate_kv_cache(draft[1], self.num_kv_blocks, args.block_size, kv_dtype, self.device)
                            if draft is not None else None)
            tokens, seqs, blocks = sizing.draft_input_sizes(args, self.max_model_len)
            # The draft builds and draws k times a step: k host staging buffers each, so
            # none waits for the device to have read the one before (buffers.py).
            slots = spec.num_speculative_tokens if draft is not None else 1
            self.speculator = Speculator(spec, make_proposer(
                spec, draft, self.kv_cache, draft_layers,
                StepInputBuilder(tokens, seqs, blocks, args.block_size, self.device, staging_slots=slots),
                Sampler(args.seed + 1, self.device, args.max_num_seqs, staging_slots=slots), cfg.vocab_size))
            if draft_layers is not None:
                self.kv_cache_bytes += kv_bytes(draft_layers)
            self.scheduler.may_speculate = Speculator.can_speculate
            if self.speculator.in_runner:       # the draft proposes inside the runner's step
                self.runner.drafter = self.speculator.proposer
                self.scheduler.num_lookahead_tokens = spec.num_speculative_tokens
                if self.use_cuda_graphs:        # (a draft runs on one rank: no collectives)
                    self.runner.drafter.graphs = capture_decode_graphs(
                        self.runner.drafter, args.max_num_seqs, self.max_model_len,
                        sizing.draft_verify_query_len(args), of="the draft model")
        self.outputs = OutputProcessor(self.tokenizer)
        self.limits = RequestLimits.from_args(args)
        # Requests with a deadline (request_timeout_s), by deadline, on this clock (a test
        # may replace it; grammar compile limits stay on time.monotonic).
        self._deadlines: Deadlines[tuple[Request, float, str]] = Deadlines()
        self.clock: Callable[[], float] = time.monotonic
        self._ids = itertools.count()
        self.num_prompt_tokens_total = 0
        # Async scheduling (EngineArgs.async_scheduling): the step on the device, whose
        # result the next core_step collects.
        self.async_scheduling = args.use_async_scheduling
        self._in_flight: Optional[LaunchedStep] = None
        # Pipeline parallelism: micro-batches in flight (batch_queue.py).
        self.batch_queue = (BatchQueue(args.num_batches_in_flight, self.scheduler, self.runner, self._update)
                            if args.num_batches_in_flight > 1 else None)
        freeze_heap()

    def _profile_memory(self, kv_dtype: torch.dtype) -> sizing.MemoryProfile:
        """CUDA, before the KV cache: the profile run (backend/engine/profile_run.py) where
        this rank can run a step alone; under tensor parallelism (each rank's forward needs
        the others) or with an exported-graph runner, the driver's figures on rank 0's
        device and an estimated activation peak."""
        if self.model is not None and self.workers is None:
            return profile_run.profile_memory(self.model, self.args, kv_dtype, self.device,
                                              self.model_config.vocab_size)
        dtype_bytes = torch.tensor([], dtype=self.dtype).element_size()
        return profile_run.estimated_profile(self.model_config, self.args, dtype_bytes, self.device)

    def _make_runner(self, kv_layers) -> ModelRunner:
        args = self.args
        sampler = Sampler(args.seed, self.device, args.max_num_seqs)
        inputs = StepInputBuilder(*sizing.input_sizes(self.args, self.max_model_len), args.block_size, self.device)
        if self.long_rope_original is not None:
            inputs.long_rope = (self.long_rope_original, self.max_position)
        common = (kv_layers, args.block_size, self.device, sampler, self.kv_cache.block_table, inputs,
                  self.model_config.vocab_size)
        if args.runner == "pooling":
            return PoolingModelRunner(self.model, *common, pooler=args.pooler)
        if args.model_runner == "torch":
            return ModelRunner(self.model, *common, workers=self.workers, lora=self.lora)
        from backend.engine.graph_runner import GraphModelRunner, OnnxRuntimeGraph, TensorRTGraph
        if not os.path.isfile(args.model_graph):
            raise ConfigError(f"invalid engine argument 'model_graph': no file at '{args.model_graph}'")
        try:
            graph = (OnnxRuntimeGraph(args.model_graph, self.model_config.num_layers, args.block_size)
                     if args.model_runner == "onnxruntime" else TensorRTGraph(args.model_graph, self.device))
        except ImportError as e:
            raise ConfigError(f"invalid engine argument 'model_runner': '{args.model_runner}' needs a package "
                              f"that is not installed ({e})") from None
        return GraphModelRunner(graph, *common)

    def check_health(self) -> None:
        """Raises EngineDeadError when a part of the engine outside this thread is gone
        (a tensor-parallel rank). Cheap: called by the engine loop every iteration."""
        if self.workers is not None:
            self.workers.check_health()

    def _cpu_shards(self) -> Optional[ShardedForward]:
        """The forward split by sequences over threads (cpu_shards.py): only the torch
        model's eager path on CPU, on one rank, without LoRA (its row groups are the whole
        step's); by default only where the weights fit in the last-level cache."""
        eligible = (type(self.runner) is ModelRunner and self.device.type == "cpu"
                    and self.attention_backend == "torch" and self.workers is None and self.lora is None)
        requested = self.args.cpu_forward_shards
        if requested is not None and requested > 1 and not eligible:
            raise ConfigError(f"invalid engine argument 'cpu_forward_shards': {requested} shards need the torch "
                              "model on CPU with attention_backend 'torch', one rank, no LoRA and runner 'generate'; "
                              "leave it unset")
        return sharded_forward(requested, eligible, self.model_config.hidden_size, self.model_config.num_layers,
                               self.bytes_per_rank[0][0])

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks, if any, and the forward's shard threads (the
        engine is unusable after)."""
        if self.workers is not None:
            self.workers.shutdown()
        shards = getattr(getattr(self, "runner", None), "shards", None)     # (a load that failed early)
        if shards is not None:
            shards.close()

    @property
    def num_generation_tokens_total(self) -> int:
        return self.scheduler.num_generation_tokens_total

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.num_unfinished > 0 or self._in_flight is not None
                or (self.batch_queue is not None and self.batch_queue.busy))

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One engine step and its outputs' text, inline (offline use and tests; servers
        run the output side on its own thread: engine_loop.py)."""
        outputs, stopped = self.outputs.process(self.core_step())
        self.stop_requests(stopped)
        return outputs

    def core_step(self) -> list[EngineCoreOutput]:
        """Schedule, execute, update: the engine thread's whole job.

        With async scheduling the step launched here is collected by the next call, so
        the host schedules and builds step N+1 while the device runs step N:
        schedule N+1 (step N's sampled tokens are placeholders) -> launch N+1 (its
        placeholders filled from step N's ids on the device) -> collect N (the one host
        sync) -> update from N (stops, seen one step behind: a request that stopped at
        N has a row in N+1 whose token is dropped) -> sample N+1 (penalties, min_tokens
        and grammars include N's tokens). Without it, the same calls run in series."""
        # (a moment's wait for a grammar when nothing else could run)
        outputs = self._expire_deadlines(self.clock()) + self.scheduler.update_grammars(
            wait_s=0.01 if not self.scheduler.running and self._in_flight is None else 0.0)
        if self.batch_queue is not None:
            return outputs + self.batch_queue.step()
        sched = self.scheduler.schedule()
        prev, self._in_flight = self._in_flight, None
        if sched.is_empty and prev is None:
            return outputs
        try:
            if not self.async_scheduling:
                return outputs + self._update(sched, self.runner.execute(sched))
            launched = None if sched.is_empty else self.runner.launch(sched, prev)
            if prev is not None:
                outputs += self._update(prev.sched, self.runner.collect(prev),
                                        launched.sched if launched is not None else None)
            if launched is not None:
                self.runner.sample(launched)
                self._in_flight = launched
        except Exception as e:
            if self.workers is not None:    # name the rank whose death broke the collective
                self.workers.raise_if_dead(wait_s=1.0, cause=e)
            raise
        return outputs

    def _update(self, sched, result: ModelRunnerOutput, in_flight=None) -> list[EngineCoreOutput]:
        """Step `sched`'s result applied (with a draft model's proposals, made inside the
        step), then a lookup's proposals. `in_flight`: the step launched since (async
        scheduling); a request in it proposes after that step."""
        outputs = self.scheduler.update_from_output(sched, result)
        if self.speculator is not None:
            self.speculator.record(sched.scheduled)
            self.speculator.forget(s.request.request_id for s in sched.scheduled if s.request.is_finished)
            if not self.speculator.in_runner:
                running = [s.request for s in sched.scheduled if not s.request.is_finished]
                ahead = {s.request.request_id for s in in_flight.scheduled} if in_flight else set()
                eligible = [(r, k) for r, k in self.speculator.eligible(running) if r.request_id not in ahead]
                self.scheduler.set_proposals(self.speculator.propose(running, eligible))
        return outputs

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """The engine's figures: KV cache (blocks, bytes per rank, prefix-cache queries and
        hits), scheduler (running, waiting, preemptions, chunked prefills), speculation and
        LoRA, when on. Cheap; read by the metrics thread."""
        kv = self.kv_cache
        total = kv.num_total_blocks
        free = kv.num_free_blocks
        return {
            "num_total_blocks": total,
            "num_free_blocks": free,
            "num_used_blocks": total - free,
            "usage_ratio": (total - free) / total,
            "block_size": self.args.block_size,
            "kv_cache_bytes": self.kv_cache_bytes,           # per rank
            "tensor_parallel_size": self.args.tensor_parallel_size,
            "pipeline_parallel_size": self.args.pipeline_parallel_size,
            "bytes_per_rank": self.bytes_per_rank,
            "kv_cache_dtype": str(self.runner.kv_caches[0].key.dtype).replace("torch.", ""),
            "num_cached_blocks": len(kv.pool.cached),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_chunked_prefills": self.scheduler.num_chunked_prefills,
            "num_long_rope_restarts": self.scheduler.num_long_rope_restarts,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hit_tokens": kv.prefix_cache_hit_tokens,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "max_model_len": self.max_model_len,
            **(self.speculator.stats() if self.speculator is not None else {}),
            **(self.scheduler.lora_stats() if self.lora is not None else {}),
            **(self.batch_queue.stats() if self.batch_queue is not None else {}),
        }
