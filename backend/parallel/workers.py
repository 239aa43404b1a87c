"""Tensor-parallel ranks 1..N-1: processes the engine starts, each holding its shard of
the weights and of every KV block, running the forward pass rank 0 plans.

Rank 0 is the engine's own process: scheduler, KV cache manager, sampler. Each step it
sends the others a short plan and the integer inputs it uploaded (one gloo broadcast
each, on a control group), then every rank runs the same forward over the same block
ids; the layers' all-reduces and the logits gather are the only other traffic. The
workers never decide anything, so they cannot drift from rank 0.

A worker that dies closes its connections: rank 0's next collective fails at once, and
`check_health()` (called by the engine loop every iteration, busy or idle) names it. A
rank 0 that dies does the same to the workers, which then exit.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import threading
import time
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from backend.engine.cuda_graphs import DecodeGraphs, capture_decode_graphs
from backend.engine.errors import EngineDeadError
from backend.engine.step_inputs import GraphShape, StepInputBuilder
from backend.parallel.group import TensorParallel, control_group, destroy_group, init_group

logger = logging.getLogger(__name__)

# Data-plane collectives (all-reduce, gather) that wait this long on a rank raise.
COLLECTIVE_TIMEOUT_S = 600.0


# ---------------------------------------------------------------- control messages
# Rank 0 tells the workers what to do with one message at a time, broadcast on the
# control group as a fixed-width int64 header: the message's kind, then its fields.

class _IntFields:
    """A message whose fields are ints, sent in declaration order."""

    def values(self) -> list[int]:
        return list(dataclasses.astuple(self))

    @classmethod
    def from_values(cls, values: list[int]):
        return cls(*values[:len(dataclasses.fields(cls))])


@dataclasses.dataclass(frozen=True)
class StopMessage(_IntFields):
    """Exit."""


@dataclasses.dataclass(frozen=True)
class SetupMessage(_IntFields):
    """The KV pool and step buffer sizes rank 0 chose; the workers answer with their
    (weight bytes, KV bytes)."""
    num_kv_blocks: int
    block_size: int
    max_tokens: int
    max_seqs: int
    max_blocks_per_seq: int


@dataclasses.dataclass(frozen=True)
class CaptureMessage(_IntFields):
    """Capture the decode (and verify) CUDA graphs (every rank at once; kept only if all
    succeed)."""
    max_num_seqs: int
    max_model_len: int
    verify_query_len: int = 0


@dataclasses.dataclass(frozen=True)
class StepMessage:
    """Run one step. The uploaded buffer prefix follows (plan[0] elements), then, with
    LoRA, each scheduled request's adapter index."""
    plan: tuple[int, ...]           # StepInputBuilder.plan(step)
    graph: Optional[GraphShape]     # the CUDA graph rank 0 replays; None: eager
    with_lora: bool = False

    WIDTH = StepInputBuilder.PLAN_LEN + 3

    def __post_init__(self) -> None:
        assert len(self.plan) == StepInputBuilder.PLAN_LEN, self.plan

    def values(self) -> list[int]:
        g = self.graph or GraphShape(0, 0)
        return [*self.plan, g.num_seqs, g.query_len, int(self.with_lora)]

    @classmethod
    def from_values(cls, values: list[int]) -> "StepMessage":
        n = StepInputBuilder.PLAN_LEN
        graph = GraphShape(values[n], values[n + 1]) if values[n] else None
        return cls(tuple(values[:n]), graph, bool(values[n + 2]))


Message = Union[StopMessage, SetupMessage, CaptureMessage, StepMessage]
_KINDS: tuple[type, ...] = (StopMessage, SetupMessage, StepMessage, CaptureMessage)
HEADER_LEN = 1 + max(StepMessage.WIDTH, *(len(dataclasses.fields(k)) for k in _KINDS if k is not StepMessage))


def encode(message: Message) -> torch.Tensor:
    """The message as the fixed-width header broadcast on the control group."""
    values = [_KINDS.index(type(message)), *message.values()]
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[:len(values)] = torch.tensor(values, dtype=torch.int64)
    return header


def decode(header: torch.Tensor) -> Message:
    kind, *values = header.tolist()
    return _KINDS[kind].from_values(values)


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a rank needs to build its shard (picklable: it crosses the spawn)."""
    model: str
    size: int
    init_method: str
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

    def device(self) -> torch.device:
        return torch.device("cuda", self.rank) if self.device_type == "cuda" else torch.device("cpu")


def model_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes(kv_caches) -> int:
    return sum(c.key.nbytes + c.value.nbytes for c in kv_caches)


class TensorParallelWorkers:
    """Rank 0's handle on the other ranks."""

    def __init__(self, spec: WorkerSpec, start_timeout_s: float = 600.0) -> None:
        self.size = spec.size
        self._dir = tempfile.mkdtemp(prefix="paged_llm_tp_")
        spec = dataclasses.replace(spec, init_method="file://" + os.path.join(self._dir, "rendezvous"))
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=worker_main, args=(dataclasses.replace(spec, rank=r),),
                                  name=f"paged_llm-tp-rank{r}", daemon=True)
                      for r in range(1, spec.size)]
        self._closed = False
        # On CPU the ranks share the machine's cores: each takes its share (the workers
        # do the same), or they would oversubscribe it. Given back at shutdown.
        self._threads = torch.get_num_threads()
        if spec.device_type == "cpu":
            torch.set_num_threads(cpu_share(spec.size))
        for p in self.procs:
            p.start()
        self.tp: TensorParallel = self._join(spec, start_timeout_s)
        self.ctrl = control_group()

    def _join(self, spec: WorkerSpec, timeout_s: float) -> TensorParallel:
        """Rendezvous with the workers, failing fast (not after the store's timeout) when
        one of them dies while starting."""
        result: list = []

        def join() -> None:
            try:
                result.append(init_group(0, spec.size, spec.init_method, spec.device(), COLLECTIVE_TIMEOUT_S))
            except Exception as e:  # reported below
                result.append(e)

        thread = threading.Thread(target=join, name="tp-rendezvous", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while thread.is_alive():
            thread.join(0.1)
            dead = self._dead()
            if dead or time.monotonic() > deadline:
                self.shutdown()
                raise EngineDeadError(f"tensor parallel startup failed: {dead or 'the ranks did not meet in time'}")
        if isinstance(result[0], Exception):
            self.shutdown()
            raise EngineDeadError(f"tensor parallel startup failed: {result[0]}")
        return result[0]

    def setup(self, num_kv_blocks: int, block_size: int, input_sizes: tuple[int, int, int],
              weight_bytes: int, kv_cache_bytes: int) -> list[tuple[int, int]]:
        """Tell the workers the KV pool and step buffer sizes rank 0 chose; returns every
        rank's (weight bytes, KV bytes), rank 0 first."""
        self._send(SetupMessage(num_kv_blocks, block_size, *input_sizes))
        mine = torch.tensor([weight_bytes, kv_cache_bytes], dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.gather(mine, parts, dst=0, group=self.ctrl)
        return [(int(p[0]), int(p[1])) for p in parts]

    def send_step(self, plan: list[int], host_prefix: Callable[[int], torch.Tensor],
                  graph: Optional[GraphShape] = None, lora_ids: Optional[list[int]] = None) -> None:
        """graph: the CUDA graph rank 0 replays for this step, None for eager.
        lora_ids (with LoRA): each scheduled request's adapter, as an index into
        lora_modules (-1: base); the ranks make the same slot choices from them."""
        self.check_health()
        self._send(StepMessage(tuple(plan), graph, lora_ids is not None))
        dist.broadcast(host_prefix(plan[0]), 0, group=self.ctrl)
        if lora_ids is not None:
            dist.broadcast(torch.tensor(lora_ids, dtype=torch.int64), 0, group=self.ctrl)

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
        dist.broadcast(encode(message), 0, group=self.ctrl)

    def _dead(self) -> str:
        return "; ".join(f"tensor parallel rank {r} (pid {p.pid}) exited with code {p.exitcode}"
                         for r, p in enumerate(self.procs, start=1) if not p.is_alive())

    def check_health(self) -> None:
        dead = self._dead()
        if dead:
            raise EngineDeadError(dead)

    def raise_if_dead(self, wait_s: float, cause: BaseException) -> None:
        """After a failed collective: a rank that died is the likely cause, and its exit
        can trail its closed connections by a moment."""
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
                self._send(StopMessage())
            except Exception:       # a rank died meanwhile; the kill below covers it
                pass
        for p in self.procs:
            p.join(timeout=10.0 if p.is_alive() and not self._dead() else 1.0)
            if p.is_alive():
                p.kill()
                p.join()
        destroy_group()
        shutil.rmtree(self._dir, ignore_errors=True)
        torch.set_num_threads(self._threads)


def cpu_share(size: int) -> int:
    return max(1, (os.cpu_count() or 1) // size)


def agree(ok: bool, group) -> bool:
    """True on every rank if `ok` on every rank."""
    flag = torch.tensor([int(ok)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def worker_main(spec: WorkerSpec) -> None:
    """Entry point of ranks 1..N-1 (a spawned process)."""
    # Imported here: the engine imports this module, and a spawned child imports only what it runs.
    from backend.attention import make_attention_factory
    from backend.config import EngineArgs
    from backend.engine.model_runner import ModelRunner, allocate_kv_cache
    from backend.lora import make_lora_manager
    from backend.models.config import load_model_config
    from backend.models.loader import load_model
    from backend.ops import make_layer_ops
    from backend.parallel.sharding import local_config
    from backend.parallel.moe_sharding import with_expert_parallel

    logging.basicConfig(level=logging.INFO, format=f"[paged_llm tp rank {spec.rank}] %(message)s")
    device = spec.device()
    if device.type == "cpu":
        torch.set_num_threads(cpu_share(spec.size))
    else:
        torch.cuda.set_device(device)
    tp = init_group(spec.rank, spec.size, spec.init_method, device, COLLECTIVE_TIMEOUT_S)
    ctrl = control_group()
    try:
        cfg = with_expert_parallel(load_model_config(spec.model), spec.enable_expert_parallel)
        model = load_model(spec.model, cfg, getattr(torch, spec.dtype), device,
                           make_attention_factory(spec.attention_backend), spec.max_position,
                           make_layer_ops(spec.attention_backend), tp)
        lora = None
        if spec.lora_engine_args is not None:
            lora = make_lora_manager(EngineArgs(**spec.lora_engine_args), cfg, model, device,
                                     getattr(torch, spec.dtype), spec.attention_backend, spec.rank, spec.size)
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        dist.broadcast(header, 0, group=ctrl)
        setup = decode(header)
        if not isinstance(setup, SetupMessage):
            return
        kv_caches = allocate_kv_cache(local_config(cfg, spec.size), setup.num_kv_blocks, setup.block_size,
                                      getattr(torch, spec.kv_dtype), device)
        if spec.kv_cache_scales:
            from backend.engine.kv_int8 import load_kv_cache_scales, set_kv_cache_scales
            from backend.parallel.sharding import kv_head_range
            set_kv_cache_scales(kv_caches, load_kv_cache_scales(spec.kv_cache_scales, cfg,
                                                                kv_head_range(cfg, spec.rank, spec.size)))
        inputs = StepInputBuilder(setup.max_tokens, setup.max_seqs, setup.max_blocks_per_seq, setup.block_size,
                                  device)
        # The runner rank 0 runs, for its forward path (graph replay or eager); this rank
        # never samples, so it has no sampler and no block tables of its own.
        runner = ModelRunner(model, kv_caches, setup.block_size, device, None, None, inputs, cfg.vocab_size,
                             lora=lora)
        dist.gather(torch.tensor([model_bytes(model), kv_bytes(kv_caches)], dtype=torch.int64), None,
                    dst=0, group=ctrl)
        with torch.inference_mode():
            while True:
                dist.broadcast(header, 0, group=ctrl)
                message = decode(header)
                if isinstance(message, CaptureMessage):
                    graphs = capture_decode_graphs(runner, message.max_num_seqs, message.max_model_len,
                                                   message.verify_query_len)
                    runner.graphs = graphs if agree(graphs is not None, ctrl) else None
                    continue
                if not isinstance(message, StepMessage):
                    return
                inputs.buffer.writable()
                dist.broadcast(inputs.host_prefix(message.plan[0]), 0, group=ctrl)
                step = inputs.rebuild(list(message.plan))
                if message.with_lora:
                    ids = torch.empty(step.num_seqs, dtype=torch.int64)
                    dist.broadcast(ids, 0, group=ctrl)
                    lora.prepare(lora.names_of(ids.tolist()), step.meta.query_lens_cpu[:step.num_seqs],
                                 message.graph.num_seqs if message.graph is not None else None)
                runner.run_forward(step, message.graph)
    except Exception:
        # Rank 0 sees the closed connections at once; the reason goes to the log.
        logging.getLogger(__name__).exception("tensor parallel rank %d failed", spec.rank)
        raise SystemExit(1)
    finally:
        destroy_group()
