"""Ranks 1..N-1 (tensor and pipeline parallel): processes the engine starts, or a worker
node's agent starts (backend/parallel/node.py), each holding its shard of the weights
and of every KV block, running each step rank 0 sends (backend/parallel/rank.py).

Rank 0 is the engine's own process: scheduler, KV cache manager, sampler. Each step it
sends the others the typed step (vLLM's SchedulerOutput idea): a short header, then the
runner's journal since the last step (step_payload.py: the typed steps applied and the
tokens sampled), one gloo broadcast each on a control group. Every rank keeps request
states of its own from it (runner/request_state.py), builds the step's inputs from them
as rank 0 does, and runs its shard of the same forward over the same block ids; the
layers' all-reduces and the logits gather are the only other traffic. The workers never
decide anything (no scheduling, no sampling); each checks that it built the inputs rank
0 built (a digest in the step's header), so a rank that drifted fails at once instead of
adding its shard of other tokens.

The ranks meet through a torch.distributed TCP store that rank 0 serves (on loopback,
on a port the OS picks, when every rank is on this machine; at master_addr:master_port
for worker nodes). A worker that dies closes its connections: rank 0's next collective
fails at once, and `check_health()` (called by the engine loop every iteration, busy or
idle) names it; a worker node is watched through its agent's heartbeats
(backend/parallel/nodes.py). A rank 0 that dies does the same to the workers, which then
exit.
"""

from __future__ import annotations

import dataclasses
import logging
import datetime
import os
import threading
import time
from typing import Callable, NoReturn, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from backend.engine.runner.cuda_graphs import DecodeGraphs
from backend.engine.errors import EngineDeadError
from backend.engine.runner.step_inputs import GraphShape
from backend.parallel.group import TensorParallel, control_group, destroy_group, init_group
from backend.parallel.messages import (CaptureMessage, Message, SetupMessage, StageTimesMessage, StepMessage,
                                       StopMessage, encode)
from backend.parallel import step_payload
from backend.parallel.pending import PendingWorks
from backend.parallel.pipeline import PipelineStage
from backend.parallel.step_payload import RankStep
from backend.parallel.rank_spec import COLLECTIVE_TIMEOUT_S, WorkerSpec, agree, arrived_key, cpu_share

logger = logging.getLogger(__name__)

def start_ranks(spec: WorkerSpec, ranks: range) -> list:
    """Spawn these ranks on this machine (daemons: they go when their parent goes)."""
    from backend.parallel.rank import worker_main
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker_main, args=(dataclasses.replace(spec, rank=r),),
                         name=f"paged_llm-rank{r}", daemon=True) for r in ranks]
    for p in procs:
        p.start()
    return procs


class TensorParallelWorkers:
    """Rank 0's handle on the other ranks (tensor and pipeline parallel, on this machine
    and on worker nodes)."""

    def __init__(self, spec: WorkerSpec, num_layers: int) -> None:
        from backend.parallel.nodes import WorkerNodes
        self.size = spec.size
        self.procs: list = []
        self.nodes: Optional[WorkerNodes] = None
        self._closed = False
        self._threads = torch.get_num_threads()
        # Rank 0 serves the rendezvous; on one machine, on loopback and a free port.
        self.store = dist.TCPStore(spec.master_addr, spec.master_port, None, True,
                                   datetime.timedelta(seconds=spec.join_timeout_s), wait_for_workers=False)
        spec = dataclasses.replace(spec, master_port=self.store.port)
        if spec.nnodes > 1:
            self.nodes = WorkerNodes(spec)
        self.procs = start_ranks(spec, range(1, spec.ranks_per_node))
        # On CPU the ranks share the machine's cores: each takes its share (the workers
        # do the same), or they would oversubscribe it. Given back at shutdown.
        if spec.device_type == "cpu":
            torch.set_num_threads(cpu_share(spec.ranks_per_node))
        self.tp: TensorParallel = self._join(spec, spec.join_timeout_s)
        self.stage = PipelineStage.of(0, spec.tp_size, spec.pp_size, num_layers) if spec.pp_size > 1 else None
        self.ctrl = control_group()
        # Micro-batches in flight (backend/engine/scheduling/batch_queue.py): the step messages go
        # out asynchronously, so rank 0 never waits for a stage still busy with an
        # earlier batch to take the next step (gloo's broadcast root waits for every
        # receiver). The ranks receive them in issue order, as if sent one by one.
        self.nonblocking = False
        self._pending = PendingWorks()
        self._times_since = time.perf_counter()

    def _join(self, spec: WorkerSpec, timeout_s: float) -> TensorParallel:
        """Rendezvous with the workers, failing fast (not after the store's timeout) when
        one of them dies while starting. The process group is made only once every rank
        has arrived at the store: a rank that never comes leaves no rendezvous waiting."""
        deadline = time.monotonic() + timeout_s
        missing = list(range(1, spec.size))
        while missing:
            dead = self._dead()
            if dead or time.monotonic() > deadline:
                self._startup_failed(dead, f"ranks {missing} did not arrive in {timeout_s:g} s", timeout_s)
            missing = [r for r in missing if not self.store.check([arrived_key(r)])]
            time.sleep(0.05 if missing else 0.0)
        result: list = []

        def join() -> None:
            try:
                result.append(init_group(0, spec.size, self.store, spec.device(), COLLECTIVE_TIMEOUT_S,
                                         spec.tp_size))
            except Exception as e:  # reported below
                result.append(e)

        thread = threading.Thread(target=join, name="rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            dead = self._dead()
            if dead or time.monotonic() > deadline:
                self._startup_failed(dead, "the ranks did not meet in time", timeout_s)
        if isinstance(result[0], Exception):    # (the store's own wait ends with the join timeout too)
            self._startup_failed("", str(result[0]), timeout_s)
        return result[0]

    def _startup_failed(self, dead: str, otherwise: str, timeout_s: float) -> NoReturn:
        late = self.nodes.not_joined(timeout_s) if self.nodes is not None else ""
        self.shutdown()
        raise EngineDeadError(f"parallel startup failed: {dead or late or otherwise}")

    def setup(self, num_kv_blocks: int, block_size: int, input_sizes: tuple[int, int, int],
              weight_bytes: int, kv_cache_bytes: int) -> list[tuple[int, int]]:
        """Tell the workers the KV pool and step buffer sizes rank 0 chose; returns every
        rank's (weight bytes, KV bytes), rank 0 first."""
        self._send(SetupMessage(num_kv_blocks, block_size, *input_sizes))
        mine = torch.tensor([weight_bytes, kv_cache_bytes], dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.gather(mine, parts, dst=0, group=self.ctrl)
        return [(int(p[0]), int(p[1])) for p in parts]

    def send_step(self, journal: list, inputs_digest: int, graph: Optional[GraphShape] = None,
                  lora_ids: Optional[list[int]] = None) -> None:
        """The step as each rank builds it (step_payload.py): the runner's journal since
        the last step (RequestStates.take_journal), ending with the step, and the digest
        of the inputs rank 0 built from it (StepInputBuilder.digest). graph: the CUDA
        graph rank 0 replays for this step, None for eager. lora_ids (with LoRA): each
        scheduled request's adapter, as an index into lora_modules (-1: base); the ranks
        make the same slot choices from them."""
        self.check_health()
        payload = step_payload.encode(RankStep(journal, lora_ids))
        self._send(StepMessage.of(int(payload.shape[0]), inputs_digest, graph))
        self._broadcast(payload)

    def stage_times(self, model, reset: bool = False) -> list[tuple[float, float]]:
        """Pipeline parallelism: every rank's (seconds spent waiting on other ranks,
        seconds since the timers were reset), rank 0 first (`model`: its stage's
        PipelineStageModel). Call from the engine thread between steps."""
        self._pending.wait_all()
        self._send(StageTimesMessage(int(reset)))
        now = time.perf_counter()
        mine = torch.tensor([int(model.wait_s * 1e9), int((now - self._times_since) * 1e9)], dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.gather(mine, parts, dst=0, group=self.ctrl)
        if reset:
            model.wait_s, self._times_since = 0.0, now
        return [(int(p[0]) / 1e9, int(p[1]) / 1e9) for p in parts]

    def capture_graphs(self, capture: Callable[[], Optional[DecodeGraphs]], max_num_seqs: int,
                       max_model_len: int, verify_query_len: int = 0) -> Optional[DecodeGraphs]:
        """Every rank captures its decode (and verify) graphs at once (`capture` is rank
        0's part); they are kept only if every rank succeeded."""
        self._send(CaptureMessage(max_num_seqs, max_model_len, verify_query_len))
        graphs = capture()
        if not agree(graphs is not None, self.ctrl):
            logger.warning("a tensor-parallel rank could not capture its CUDA graphs: every rank runs eagerly")
            return None
        return graphs

    def _send(self, message: Message) -> None:
        self._broadcast(encode(message))

    def _broadcast(self, tensor: torch.Tensor) -> None:
        if not self.nonblocking:
            dist.broadcast(tensor, 0, group=self.ctrl)
            return
        # (each tensor sent is made for its message; the pending list keeps it until sent)
        self._pending.add(dist.broadcast(tensor, 0, group=self.ctrl, async_op=True), tensor)

    def _dead(self) -> str:
        local = [f"tensor parallel rank {r} (pid {p.pid}) exited with code {p.exitcode}"
                 for r, p in enumerate(self.procs, start=1) if not p.is_alive()]
        remote = self.nodes.dead() if self.nodes is not None else ""
        return "; ".join(local + ([remote] if remote else []))

    def check_health(self) -> None:
        dead = self._dead()
        if dead:
            raise EngineDeadError(dead)

    def raise_if_dead(self, wait_s: float, cause: BaseException) -> None:
        """After a failed collective: a rank that died is the likely cause, and its exit
        can trail its closed connections by a moment (a worker node's, until its
        heartbeats are overdue)."""
        if self.nodes is not None:
            wait_s = max(wait_s, self.nodes.health_timeout_s + 1.0)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            dead = self._dead()
            if dead:
                raise EngineDeadError(dead) from cause
            time.sleep(0.02)

    def shutdown(self) -> None:
        """Stop every worker (asked first, killed after a grace) and leave the group."""
        if self._closed:
            return
        self._closed = True
        if dist.is_initialized() and not self._dead():
            try:
                self.nonblocking = False
                self._pending.wait_all()
                self._send(StopMessage())
            except Exception:       # a rank died meanwhile; the kill below covers it
                pass
        for p in self.procs:
            p.join(timeout=10.0 if p.is_alive() and not self._dead() else 1.0)
            if p.is_alive():
                p.kill()
                p.join()
        destroy_group()
        torch.set_num_threads(self._threads)


def check_world(cfg, args, device: torch.device) -> None:
    """pipeline_parallel_size against the checkpoint, and each node's ranks against its
    visible GPUs (tensor_parallel_size alone: sizing.check_tensor_parallel_size)."""
    from backend.config import ConfigError
    from backend.parallel.pipeline import check_pipeline_parallel
    problem = check_pipeline_parallel(cfg, args.pipeline_parallel_size)
    if problem:
        raise ConfigError(f"invalid engine argument 'pipeline_parallel_size': {args.pipeline_parallel_size} "
                          f"({problem})")
    per_node = args.world_size // args.nnodes
    if device.type == "cuda" and args.pipeline_parallel_size > 1 and torch.cuda.device_count() < per_node:
        raise ConfigError(f"invalid engine argument 'pipeline_parallel_size': {args.pipeline_parallel_size} "
                          f"({per_node} ranks on this node, {torch.cuda.device_count()} CUDA devices visible)")


def worker_spec(args, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, attention_backend: str,
                max_position: int) -> WorkerSpec:
    """What every rank builds, from the engine arguments. On one machine the rendezvous
    is on loopback at a port the OS picks; with worker nodes at master_addr:master_port
    (MASTER_ADDR / MASTER_PORT, else 29500), which the head serves."""
    multi = args.nnodes > 1
    return WorkerSpec(
        model=args.model, size=args.world_size, device_type=device.type,
        dtype=str(dtype).replace("torch.", ""), kv_dtype=str(kv_dtype).replace("torch.", ""),
        attention_backend=attention_backend, max_position=max_position,
        enable_expert_parallel=args.enable_expert_parallel,
        lora_engine_args=args.model_dump() if args.enable_lora else None,
        pp_size=args.pipeline_parallel_size, nnodes=args.nnodes,
        master_addr=(args.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1") if multi else "127.0.0.1",
        master_port=(args.master_port or int(os.environ.get("MASTER_PORT") or 29500)) if multi else 0,
        join_timeout_s=args.node_join_timeout_s, node_health_timeout_s=args.node_health_timeout_s,
        kv_cache_scales=args.kv_cache_scales)
