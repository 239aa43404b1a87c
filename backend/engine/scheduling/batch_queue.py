"""Micro-batches in flight under pipeline parallelism (vLLM's batch queue,
`EngineCore.step_with_batch_queue`; `max_concurrent_batches` batches at once).

With one batch in flight, P-1 of the P stages idle at any moment. Rank 0 is stage 0,
the scheduler and the sampler: each engine step it schedules a batch from the requests
not in flight, launches it (its stage-0 forward, the hidden state sent on to stage 1,
the receive of its logits posted) and, once the queue is full or nothing more can be
scheduled, waits for the oldest batch's logits, samples them and applies the result.
So while the later stages run batch B, stage 0 runs batch B+1.

Exactness: the batches hold disjoint requests (the scheduler leaves out those in
flight: Scheduler.exclude_in_flight), so no step needs a token another batch in flight
has not sampled yet, and every stage runs the batches in launch order, so a KV block a
batch gives back (a request preempted or aborted while in flight) and a later batch
reuses is written by the later batch last. Each batch takes about 1/M of the requests
that could run (M = max_concurrent_batches), so M batches share them.

Nothing here blocks on a stage busy with an earlier batch: the steps go to the
workers asynchronously (TensorParallelWorkers.nonblocking; gloo's broadcast root would
wait for every receiver), the hidden states by `isend`, and rank 0's logits receives
are posted at launch and waited in order (PipelineStageModel.defer_logits).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Callable

from backend.engine.runner.model_runner import LaunchedStep, ModelRunner
from backend.engine.outputs import EngineCoreOutput, ModelRunnerOutput
from backend.engine.scheduling.sched_output import SchedulerOutput
from backend.engine.scheduling.scheduler import Scheduler


class BatchQueue:
    def __init__(self, max_concurrent_batches: int, scheduler: Scheduler, runner: ModelRunner,
                 update: Callable[[SchedulerOutput, ModelRunnerOutput], list[EngineCoreOutput]]) -> None:
        self.max_concurrent_batches = max_concurrent_batches
        self.scheduler = scheduler
        self.runner = runner
        self.workers = runner.workers
        self.stage_model = runner.model         # rank 0's PipelineStageModel
        self._update = update
        self.queue: deque[LaunchedStep] = deque()
        # Batches launched while another was in flight (the pipeline's overlap).
        self.num_overlapped_batches = 0
        self.num_batches = 0
        scheduler.exclude_in_flight = True
        self.workers.nonblocking = True
        self.stage_model.defer_logits = True

    @property
    def busy(self) -> bool:
        return bool(self.queue)

    def step(self) -> list[EngineCoreOutput]:
        """Launch a batch if the queue has room and something can run; then, if the queue
        is full or nothing was launched, collect the oldest batch."""
        try:
            launched = False
            if len(self.queue) < self.max_concurrent_batches:
                sched = self.scheduler.schedule(max_batch_seqs=self._share())
                if sched.is_empty:
                    self.runner.update_states(sched)    # (its finished and preempted ids)
                else:
                    self.num_overlapped_batches += bool(self.queue)
                    self.num_batches += 1
                    self.queue.append(self.runner.launch(sched))
                    launched = True
            if not self.queue or (launched and len(self.queue) < self.max_concurrent_batches):
                return []
            return self._collect()
        except Exception as e:
            self.workers.raise_if_dead(wait_s=1.0, cause=e)     # name the rank whose death broke it
            raise

    def _collect(self) -> list[EngineCoreOutput]:
        """The oldest batch: its logits awaited (none when no row samples: a prompt chunk
        alone), sampled, and its result applied; it stays in the queue until then."""
        launched = self.queue[0]
        if launched.logits is not None:
            self.stage_model.wait_logits()
        self.queue.popleft()
        self.runner.sample(launched, self.scheduler.grammar_bitmask(launched.sched))
        return self._update(launched.sched, self.runner.collect(launched))

    def _share(self) -> int:
        """A batch's share of the requests that could run: the running and waiting ones
        (at most max_num_seqs) over the batches."""
        s = self.scheduler
        return max(1, math.ceil(min(s.max_num_seqs, len(s.running) + len(s.waiting)) / self.max_concurrent_batches))

    def stats(self) -> dict:
        return {"max_concurrent_batches": self.max_concurrent_batches, "num_batches": self.num_batches,
                "num_overlapped_batches": self.num_overlapped_batches}
