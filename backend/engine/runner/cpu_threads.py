"""The engine thread's intra-op threads on CPU, step by step: one for a step too small to
share, the engine's share for the rest.

torch's CPU ops run on libgomp, whose workers sleep between parallel regions under the
engine's OMP_WAIT_POLICY=PASSIVE (backend/__init__.py). Every op with more than one
thread wakes them: a 1 x 256 x 256 linear took 66 us with two threads against 7 us with
one on the CI machine (2 cores). A small model's step is hundreds of such ops, so a
batch-1 decode of the default model (hidden 256, 4 layers) ran at 229 tok/s with two
threads and 367 with one, while a 128-token prompt was faster with two (9.5 against
10.9 ms): there the ops have work to share (docs/archive/benchmarks.md section 34).

So the engine's thread runs a step with one thread when the step's work (cpu_shards'
flop proxy) is worth less than two shards, and with `busy` threads otherwise (all of
them, or one shard's share when the forward is split: cpu_shards.py). Only where the
weights fit in the last-level cache: beyond it even a one-row step streams them from
memory, and two threads read faster (hidden 1024: 36.7 against 26.2 tok/s at batch 1).
What follows the forward on the same thread (the sampler, a drafter's forwards) runs
with the count the step set.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

# A step's work on CPU, in tokens' worth (sequence_costs), as the split forward
# (cpu_shards.py) and the thread count here weigh it. A sequence costs its new tokens
# (the projections) and, per new token, the keys it attends to. Per layer a token costs
# ~32 h^2 flops in the projections and a key ~4 h in attention (h: hidden size), so a key
# weighs ~1 / (8 h) of a token by flops; the attention's gather and small batched ops
# make it far dearer than that. Measured on the default model (bench_vllm_peer, 2
# interleaved runs each): 4 / h 2,729 tok/s, 16 / h 2,823, 64 / h 2,835; the shards'
# imbalance changed little from 64 / h to 1024 / h.
KEY_WEIGHT = 32.0         # x 1 / hidden_size


def sequence_costs(query_lens: list[int], seq_lens: list[int], hidden_size: int) -> list[float]:
    """Each sequence's estimated work in the step, in tokens' worth."""
    key_weight = KEY_WEIGHT / hidden_size
    return [q * (1.0 + key_weight * s) for q, s in zip(query_lens, seq_lens)]


# The work (sequence_costs x h^2 x layers, a flop proxy) from which an unsplit step runs
# with every intra-op thread; below it, one (StepThreads). Twice the split forward's
# minimum shard work as it was when this was measured (docs/archive/benchmarks.md section
# 34: a 128-token prompt alone 9.5-9.8 ms with two threads against 10.7-11.0 with one, a
# 16-token one 4.1 with one against 5.3-5.6 with two). Kept apart from cpu_shards'
# MIN_SHARD_WORK, which section 35 raised for splitting, a different choice.
MIN_SHARED_STEP_WORK = 64e6


# Per thread: the intra-op threads it had before this module changed them, so that the
# offline API can give the user's thread its count back, and an engine built later on
# the same thread (tests build many) decides as the first did. (Thread-local, not keyed
# by thread id: a new thread may reuse a dead one's id.)
_threads_before = threading.local()


def set_caller_threads(n: int) -> None:
    """This thread's intra-op threads, the count it had before kept for restore_caller_threads."""
    if getattr(_threads_before, "count", None) is None:
        _threads_before.count = torch.get_num_threads()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def restore_caller_threads() -> None:
    """This thread's intra-op threads back to what they were before this module changed
    them. The offline API calls it when `generate` returns: there the engine's thread is
    the user's. Code that steps an LLMEngine itself on its own thread calls it too, or keeps
    the last step's count (torch also takes it as the default of threads started later)."""
    count = getattr(_threads_before, "count", None)
    if count is not None:
        torch.set_num_threads(count)
        _threads_before.count = None


def intra_op_threads() -> int:
    """This thread's intra-op threads as they were before this module changed them."""
    return getattr(_threads_before, "count", None) or torch.get_num_threads()


class StepThreads:
    """Sets the calling thread's intra-op threads for each step: one when `small(meta)`,
    else `busy`. `min_cost`: the step cost (sequence_costs' units) from which a step is
    not small."""

    def __init__(self, busy: int, hidden_size: int, min_cost: float) -> None:
        self.busy = busy
        self.hidden_size = hidden_size
        self.min_cost = min_cost

    def small(self, meta) -> bool:
        return sum(sequence_costs(meta.query_lens_cpu, meta.seq_lens_cpu, self.hidden_size)) < self.min_cost

    def apply(self, meta) -> None:
        set_caller_threads(1 if self.small(meta) else self.busy)


def step_threads(eligible: bool, busy: int, hidden_size: int, num_layers: int, fits_cache: bool,
                 min_work: float) -> Optional[StepThreads]:
    """The engine's policy: None where it would not change anything (one thread) or does
    not apply (not the torch model on CPU on one rank, or weights beyond the cache).
    `min_work`: the work (sequence_costs x h^2 x layers, a flop proxy) from which a step
    runs with `busy` threads."""
    if not eligible or not fits_cache or intra_op_threads() < 2:
        return None
    return StepThreads(busy, hidden_size, min_work / (hidden_size ** 2 * num_layers))
