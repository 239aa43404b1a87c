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

import itertools
import time

import torch
from typing import Callable, Optional

from backend.config import EngineArgs
from backend.engine.assembly import assemble
from backend.engine.scheduling.batch_queue import BatchQueue
from backend.engine.deadlines import Deadlines
from backend.engine.gc_policy import freeze_heap
from backend.engine.intake import Prompt, RequestIntake  # noqa: F401 (Prompt: part of this module's API)
from backend.engine.runner.model_runner import LaunchedStep
from backend.engine.output_processor import OutputProcessor
from backend.engine.outputs import EngineCoreOutput, ModelRunnerOutput, RequestOutput
from backend.engine.request import Request
from backend.engine.request_limits import RequestLimits
from backend.engine.runtime_lora import RuntimeLoRA
from backend.engine.scheduling.priority import counts_by_priority
from backend.engine.kv_events.collector import lora_id
from backend.engine.sleep_mode import SleepMode
from backend.sampling_params import SamplingParams

class LLMEngine(RequestIntake):
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        parts = assemble(args)          # the composition root (assembly.py); it cleans up after a failure
        self.workers = parts.workers
        self.model_config, self.device, self.dtype = parts.model_config, parts.device, parts.dtype
        self.attention_backend, self.max_position = parts.attention_backend, parts.max_position
        self.long_rope_original, self.model, self.lora = parts.long_rope_original, parts.model, parts.lora
        self.tokenizer, self.use_cuda_graphs = parts.tokenizer, parts.use_cuda_graphs
        self.memory_profile = parts.memory_profile
        self.num_kv_blocks, self.max_model_len = parts.num_kv_blocks, parts.max_model_len
        self.kv_cache_bytes, self.bytes_per_rank = parts.kv_cache_bytes, parts.bytes_per_rank
        self.kv_cache, self.scheduler, self.runner = parts.kv_cache, parts.scheduler, parts.runner
        self.speculator = parts.speculator
        self.kv_events = parts.kv_events       # KV cache events over ZMQ, or None
        self.handoff = parts.handoff           # prefill/decode disaggregation's blocks, or None
        self.vision = parts.vision             # vision-language models' processor and limits, or None
        try:
            self._build_step_side(args)
        except BaseException:
            self.shutdown()         # tensor-parallel ranks and shard threads already started
            raise

    def _build_step_side(self, args: EngineArgs) -> None:
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
        self.async_scheduling = args.async_scheduling_on(self.device.type)
        self._in_flight: Optional[LaunchedStep] = None
        # Pipeline parallelism: micro-batches in flight (batch_queue.py).
        self.batch_queue = (BatchQueue(args.num_batches_in_flight, self.scheduler, self.runner, self._update)
                            if args.num_batches_in_flight > 1 else None)
        # Adapters loaded and unloaded at run time (runtime_lora.py).
        self.runtime_lora = RuntimeLoRA(self.lora, self.scheduler, parallel=self.workers is not None)
        # vLLM's sleep mode: memory given back between uses (sleep_mode.py).
        self.sleep_mode = SleepMode(self)
        freeze_heap()

    def check_health(self) -> None:
        """Raises EngineDeadError when a part of the engine outside this thread is gone
        (a tensor-parallel rank). Cheap: called by the engine loop every iteration."""
        if self.workers is not None:
            self.workers.check_health()

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks, if any, and the forward's shard threads (the
        engine is unusable after)."""
        if self.workers is not None:
            self.workers.shutdown()
        if getattr(self, "kv_events", None) is not None:
            self.kv_events.shutdown()
            self.kv_events = None
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
        self.after_step()
        return outputs

    def after_step(self) -> None:
        """Between steps, on the engine thread: adapters whose unload waited for their
        requests go, and the step's KV events are handed to their publisher."""
        self.runtime_lora.finish_unloads()
        if self.scheduler.has_finished_unsent and not self.has_unfinished_requests():
            # Idle: no step will carry the finished ids, so an empty one hands them over
            # now and the runner lets go of those requests' state.
            self.runner.update_states(self.scheduler.schedule())
        if self.handoff is not None and self.handoff.held:
            self.handoff.expire()           # blocks kept for a decode engine that never came
        if self.kv_events is not None:
            self.kv_events.flush()

    def reserve_import(self, token_ids: list[int], params: SamplingParams, max_blocks: int):
        """Prefill/decode disaggregation, decode side (engine thread): blocks for a prompt's
        full blocks that another engine computed and this one lacks (kv_handoff.py); None
        when there is nothing to bring in or no room."""
        if self.handoff is None:
            return None
        salt = self.lora.salt(params.lora_name) if self.lora is not None else None
        ready = None
        if self.device.type == "cuda":
            # A block freed by a step still on the device may be reserved: the copy into it
            # waits for the work queued so far (on the copying thread, not here).
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        return self.handoff.reserve_import(token_ids, salt, max_blocks, lora_id(salt), ready)

    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as `name` from now on (vLLM's
        `add_lora`), on this thread: for offline use; servers go through EngineLoop."""
        self.runtime_lora.add(self.runtime_lora.read(name, path))

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode, on an idle engine: level 1 frees the KV cache (and on CUDA
        moves the weights to host memory), level 2 frees the weights too."""
        self.sleep_mode.sleep(level)

    def wake_up(self) -> None:
        self.sleep_mode.wake_up()

    def remove_lora(self, name: str) -> bool:
        """Stop serving `name`: new requests for it are refused, and it is dropped once
        its requests finish. True when it is gone already."""
        return self.runtime_lora.remove(name)

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
        if sched.is_empty:
            self.runner.update_states(sched)    # (every step reaches the runner: finished, preempted ids)
            if prev is None:
                return outputs
        try:
            if not self.async_scheduling:
                return outputs + self._update(sched, self.runner.execute(sched, self.scheduler.grammar_bitmask(sched)))
            launched = None if sched.is_empty else self.runner.launch(sched, prev)
            if prev is not None:
                outputs += self._update(prev.sched, self.runner.collect(prev),
                                        launched.sched if launched is not None else None)
            if launched is not None:
                self.runner.sample(launched, self.scheduler.grammar_bitmask(launched.sched))
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
            **(kv.connector.stats() if kv.connector is not None else {}),
            **(self.handoff.stats() if self.handoff is not None else {}),
            **(self.vision.encoder_cache.stats() if self.vision is not None else {}),
            **({"requests_by_priority": counts_by_priority(list(self.scheduler.running), list(self.scheduler.waiting))}
               if self.args.scheduling_policy == "priority" else {}),
            **(self.batch_queue.stats() if self.batch_queue is not None else {}),
        }
