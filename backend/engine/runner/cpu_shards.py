"""The CPU forward split by sequences over threads (engine argument `cpu_forward_shards`).

At the default model's size (hidden 256) a decode step is hundreds of small ops, too
small for torch's intra-op threads to share: with two of them the forward kept about 1.4
of 2 cores busy. Here the step's sequences are cut into contiguous shards of about equal
work, and each shard's whole forward runs on its own thread with the intra-op threads
divided between the shards (one each on 2 cores): no OpenMP barrier inside an op, and
torch's ops release the GIL, so the shards run side by side. Each sequence's rows see
the same math as in one forward (attention is per sequence, every other op per token),
and each shard writes only its own sequences' K/V slots; a sequence never reads K/V that
another writes in the same step (the prefix cache admits no hit on a block still pending,
kv_cache_manager.py).

Where a step runs (by its work, a flop proxy):
- split over the shard threads, when it is worth at least two shards (MIN_SHARD_WORK
  each) and has two sequences, unless another process holds a core (then whole on the
  calling thread, with a split step now and then to look again: CONTENDED_EFFICIENCY);
- whole, on a thread with every shard's intra-op threads, when it is worth two shards
  but is one sequence (a long prompt alone), or its split would leave one shard most
  of the work (MAX_SHARD_SHARE: a long prompt beside decode rows);
- whole, on the calling thread, when it is small: its ops are dominated by Python's
  dispatch, and handing it to another thread only adds latency.
The calling thread (the engine's) runs with one shard's share of intra-op threads, or
one for a small step (cpu_threads.StepThreads, which the engine sets before each step),
so that its own ops (the sampler, small steps) do not oversubscribe the cores the shards
use. With libgomp spinning (OMP_WAIT_POLICY=ACTIVE, or a script that loads torch before
`backend`) this matters: its OpenMP worker held a core for ~3 ms after
each of the caller's ops, and the second shard started 3.3 ms after the first (median;
0.3 ms with one share). Under the default PASSIVE policy the gain was within noise.
"""

from __future__ import annotations

import glob
import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Optional

import numpy as np
import torch

from backend.attention.metadata import AttentionMetadata, KVCacheLayer
from backend.engine.runner.cpu_threads import intra_op_threads, sequence_costs, set_caller_threads

# Work (cpu_threads.sequence_costs x h^2 x layers, a flop proxy) each shard must have. Below it the
# ops are so small that Python's dispatch dominates and two threads mostly contend for the
# GIL, and the step runs whole on the calling thread with one intra-op thread (which
# cpu_threads.StepThreads gives a step under two shards' worth). Default model (h 256, 4
# layers), decode-only steps, split against whole on one thread, median step
# (benchmarks/bench_cpu_placement.py, 2026-12-01): 16 rows of 64 tokens (40e6 in all) 7.6
# against 4.9 ms, 16 of 300 (160e6) 8.3 against 6.3, 32 of 64 (75e6) 8.7 against 6.9, 32
# of 300 (320e6) 10.2 against 10.2, 64 of 64 (150e6) 11.2 against 10.8, but 64 of 300
# (650e6) 14.9 against 18.6. (At 32e6 a shard, the value before, all but the first split; one
# thread whole had not been measured against it, as whole steps then ran with every
# intra-op thread.) vLLM's 128-sequence workload (bench_vllm_peer, alternating with the
# commit before): the same tok/s within noise, 5% fewer CPU-seconds.
MIN_SHARD_WORK = 256e6
# A core taken by another process: the shard threads then share the two cores with it,
# each step waits for the shard that got less, and one thread running the step whole
# does better (docs/archive/benchmarks.md section 16: 4,441 against 3,971 tok/s with a core
# taken). Seen as the slower shard's share of its wall time not spent waiting for a core
# (_core_clock). Below CONTENDED_EFFICIENCY (averaged over steps) the next PROBE_EVERY
# splittable steps run whole on the calling thread, then one split step measures again.
# Measured on the CPU's priority workload (bench_priority's, 2 cores, 2026-11-30), deciles
# over split steps: on a quiet machine 0.99-1.0, with a busy loop holding a core 0.50-0.59
# for most steps. The shards' CPU time over wall time (the measure before) read 0.75-0.83
# on the quiet machine, the waits for the GIL counted as lost, so the rule sent whole
# runs of 50 steps to one thread there. Only with one intra-op thread per shard (as
# measured).
CONTENDED_EFFICIENCY = 0.75
PROBE_EVERY = 50
# A split whose largest shard holds more than this share of the step's work runs whole
# instead, on all the shards' intra-op threads: a long prompt beside decode rows (a
# newcomer's first step in a busy batch) would otherwise run on one thread while the
# other shard's few rows finish early. Default model, one prompt beside 15 decode rows,
# whole against split, median step (benchmarks/bench_cpu_placement.py, 2026-12-01): 512
# tokens (share 0.99) 39.4 against 55.8 ms, 256 (0.95) 21.3 against 24.6, 128 (0.82)
# 13.1 against 14.1; earlier runs (docs/archive/benchmarks.md section 35): 112 tokens
# (0.78) 12.9 against 13.5, 96 (0.72) 12.1 against 11.8. The runs' noise is about as
# large near the threshold. Tuned with two shards.
MAX_SHARD_SHARE = 0.75
_EFFICIENCY_WEIGHT = 0.25   # of each split step in the running average


def _runqueue_wait_s() -> Optional[float]:
    """Seconds this thread has spent runnable but waiting for a core (Linux's schedstat,
    its second field); None where it cannot be read, or reads zeros (a kernel without
    scheduler statistics: its run time, the first field, stays 0)."""
    try:
        fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    except OSError:
        return None
    try:
        fields = os.pread(fd, 64, 0).split()
        return int(fields[1]) * 1e-9 if len(fields) >= 2 and int(fields[0]) > 0 else None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


# Decided once (the importing thread has run by now, so a working kernel shows run time).
_SCHEDSTAT = _runqueue_wait_s() is not None


def _core_clock() -> Optional[float]:
    """This thread's clock for the contention measure, in seconds: wall time less the
    time it spent runnable but waiting for a core (schedstat), so that a wait for the GIL
    or at an OpenMP barrier (asleep, not runnable) does not read as a taken core. Where
    the kernel does not give it (decided at import), the thread's CPU time, which does
    count those waits. None when a reading fails (the step is then not measured)."""
    if not _SCHEDSTAT:
        return time.thread_time()
    waited = _runqueue_wait_s()
    return None if waited is None else time.perf_counter() - waited


def _set_thread_count(n: int) -> None:
    """A pool thread's intra-op threads. ATen sets a thread's count lazily, at its first
    parallel op, from the value any thread set last: get_num_threads() makes it do so
    now, so a later set_num_threads on another thread cannot change this one's."""
    torch.get_num_threads()
    torch.set_num_threads(n)


def shard_bounds(cost: list[float], num_shards: int) -> list[int]:
    """Sequence indices [0, b1, ..., B] cutting the sequences into at most num_shards
    contiguous runs of about equal cost, none empty."""
    total = sum(cost)
    bounds, acc = [0], 0.0
    for i, c in enumerate(cost):
        # Cut before sequence i when more than half of it lies past the next share.
        if len(bounds) < num_shards and i > bounds[-1] and acc + c / 2 > total * len(bounds) / num_shards:
            bounds.append(i)
        acc += c
    bounds.append(len(cost))
    return bounds


def _balanced(cost: list[float], bounds: list[int]) -> bool:
    """No shard holds more than MAX_SHARD_SHARE of the step's work."""
    return max(sum(cost[a:b]) for a, b in zip(bounds, bounds[1:])) <= MAX_SHARD_SHARE * sum(cost)


def shard_meta(meta: AttentionMetadata, a: int, b: int, t0: int, t1: int) -> AttentionMetadata:
    """Sequences a:b (packed tokens t0:t1) as a step of their own."""
    return AttentionMetadata(
        query_start_loc=meta.query_start_loc[a:b + 1] - t0, seq_lens=meta.seq_lens[a:b],
        block_tables=meta.block_tables[a:b], slot_mapping=meta.slot_mapping[t0:t1],
        query_lens_cpu=meta.query_lens_cpu[a:b], seq_lens_cpu=meta.seq_lens_cpu[a:b],
        max_query_len=max(meta.query_lens_cpu[a:b]), max_seq_len=max(meta.seq_lens_cpu[a:b]))


class ShardedForward:
    """`num_shards` threads of `threads_per_shard` intra-op threads each, for a model of
    `hidden_size` and `num_layers`; `min_shard_work` (tests) replaces MIN_SHARD_WORK."""

    def __init__(self, num_shards: int, threads_per_shard: int, hidden_size: int, num_layers: int,
                 min_shard_work: Optional[float] = None) -> None:
        self.num_shards = num_shards
        self.threads_per_shard = threads_per_shard
        self.hidden_size = hidden_size
        work = MIN_SHARD_WORK if min_shard_work is None else min_shard_work
        self.min_cost = work / (hidden_size ** 2 * num_layers)             # in sequence_costs' units
        # The slower shard's core-clock time over its wall time (_core_clock), averaged
        # over split steps; splittable steps left to run whole before the next probe (see
        # CONTENDED_EFFICIENCY).
        self.efficiency = 1.0
        self.whole_steps_left = 0
        self._pool = ThreadPoolExecutor(num_shards, thread_name_prefix="cpu-shard",
                                        initializer=_set_thread_count, initargs=(threads_per_shard,))
        self._whole = ThreadPoolExecutor(1, thread_name_prefix="cpu-whole", initializer=_set_thread_count,
                                         initargs=(num_shards * threads_per_shard,))

    def __call__(self, model, kv_caches: list[KVCacheLayer], step) -> Optional[torch.Tensor]:
        """The logits of the step's sampled rows ([R, V]; run_model's result), None when
        it samples none: each shard runs the decoder over its sequences and the LM head
        over its rows, in parallel."""
        meta = step.meta
        cost = sequence_costs(meta.query_lens_cpu, meta.seq_lens_cpu, self.hidden_size)
        # How many shards the step's work is worth.
        worth = min(self.num_shards, int(sum(cost) // self.min_cost)) if self.min_cost > 0 else self.num_shards
        qsl = [0] + list(itertools.accumulate(meta.query_lens_cpu))
        rows = step.logits_indices_cpu         # which of the step's logits rows each shard computes

        def run(a: int, b: int) -> tuple[np.ndarray, Optional[torch.Tensor]]:
            t0, t1 = qsl[a], qsl[b]
            with torch.inference_mode():        # (grad and inference modes are per thread)
                hidden = model(step.input_ids[t0:t1], step.positions[t0:t1], kv_caches,
                               shard_meta(meta, a, b, t0, t1))
                mine = np.flatnonzero((rows >= t0) & (rows < t1))
                if not len(mine):
                    return mine, None
                return mine, model.compute_logits(hidden.index_select(0, torch.from_numpy(rows[mine] - t0)))

        def timed(a: int, b: int):
            wall, clock = time.perf_counter(), _core_clock()
            part = run(a, b)
            end = _core_clock()
            if clock is None or end is None:
                return part, None
            return part, (end - clock) / max(time.perf_counter() - wall, 1e-9)

        splittable = worth >= 2 and len(cost) >= 2
        if splittable and self.whole_steps_left > 0:     # a core is taken
            self.whole_steps_left -= 1
            set_caller_threads(self.threads_per_shard)
            parts = [run(0, len(cost))]
        elif splittable and _balanced(cost, bounds := shard_bounds(cost, worth)):
            set_caller_threads(self.threads_per_shard)
            futures = [self._pool.submit(timed, a, b) for a, b in zip(bounds, bounds[1:])]
            # Every shard done before anything is raised: a shard still writing K/V must
            # not outlive the step (the next one could be built meanwhile).
            wait(futures)
            results = [f.result() for f in futures]
            parts = [part for part, _ in results]
            measured = [efficiency for _, efficiency in results if efficiency is not None]
            if measured:
                self._note_efficiency(min(measured))
        elif worth >= 2:        # one long prompt alone, or one shard would hold most of the work
            parts = [self._whole.submit(run, 0, len(cost)).result()]
        else:
            parts = [run(0, len(cost))]
        if step.num_logits == 0:
            return None
        parts = [(mine, logits) for mine, logits in parts if logits is not None]
        if np.array_equal(np.concatenate([mine for mine, _ in parts]), np.arange(step.num_logits)):
            return torch.cat([logits for _, logits in parts]) if len(parts) > 1 else parts[0][1]
        out = parts[0][1].new_empty(step.num_logits, parts[0][1].shape[1])
        for mine, logits in parts:      # prompt-logprob rows follow every sampled row
            out.index_copy_(0, torch.from_numpy(mine), logits)
        return out

    def _note_efficiency(self, efficiency: float) -> None:
        """A split step's slower shard's core-clock / wall time into the running average (a probe
        after whole steps starts it afresh); below CONTENDED_EFFICIENCY, whole steps."""
        probe = self.efficiency < CONTENDED_EFFICIENCY
        self.efficiency = efficiency if probe else (
            (1 - _EFFICIENCY_WEIGHT) * self.efficiency + _EFFICIENCY_WEIGHT * efficiency)
        if self.efficiency < CONTENDED_EFFICIENCY and self.threads_per_shard == 1:
            self.whole_steps_left = PROBE_EVERY

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._whole.shutdown(wait=False)


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size, from Linux's sysfs; 32 MiB where it cannot be read."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=32 << 20)


def sharded_forward(requested: Optional[int], eligible: bool, hidden_size: int, num_layers: int,
                    weight_bytes: int) -> Optional[ShardedForward]:
    """The engine's sharded forward: `requested` shards (1: none), or by default two
    where the forward is eligible (the torch model on CPU, one rank, no LoRA), the
    engine's thread has at least two intra-op threads, which the shards then share, and
    the weights fit in the last-level cache. Each shard reads every weight: from the cache
    that costs little, from memory it doubles the traffic of GEMMs that are already bound
    by it at decode batch sizes. Measured (docs/archive/benchmarks.md section 16): the default
    model (21 MB of weights, 32 MiB L3) 1.42x faster split; a random Llama of hidden
    1024 (640 MB) 0.95x."""
    threads = intra_op_threads()
    num_shards = requested
    if num_shards is None:
        num_shards = 2 if eligible and threads >= 2 and weight_bytes <= last_level_cache_bytes() else 1
    if num_shards == 1:
        return None
    return ShardedForward(num_shards, max(1, threads // num_shards), hidden_size, num_layers)
