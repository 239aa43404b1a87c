"""The profile run that sizes the KV cache on CUDA (vLLM's scheme, our code): at load,
before the cache exists, run the largest step the engine will schedule and measure how
much memory it takes above what it started with.

The step is a prefill of max_num_batched_tokens dummy tokens spread over up to
max_num_seqs sequences (through a small KV cache of its own, allocated and freed outside
the measurement), then the sampler over max_num_seqs rows with every feature that costs
memory on: temperature, top-k near the vocabulary, top-p, min-p, repetition, frequency
and presence penalties, and logprobs at max_logprobs. With speculative decoding the
sampler runs as a verify step does instead: max_num_seqs requests with k proposals each,
max_num_seqs x (k + 1) logits rows through the rejection sampler (drawn proposals with
the draft's distributions for a draft model). The sampler's penalty tables and the
draft's held distributions are allocated before the measurement and freed after it:
sizing reserves them by arithmetic (sizing.penalty_table_bytes, draft_probs_bytes),
since they live as long as the engine or across steps.

`measure` does the bookkeeping over a `DeviceMemory`, which a test replaces with a fake;
`CudaMemory` is torch.cuda's. The arithmetic that turns the figures into KV bytes is
sizing.cuda_kv_budget. All of this runs once at load: host syncs here are fine.
"""

from __future__ import annotations

import gc
import logging
from typing import Callable, Optional, Protocol

import numpy as np
import torch

from backend.config import EngineArgs
from backend.engine.sampling import logprobs as logprob_ops
from backend.engine.sampling.logits_processors import PROCESSORS
from backend.engine.runner.model_runner import allocate_kv_cache, run_model
from backend.engine.runner.request_state import RequestState
from backend.engine.sampling.sampler import Sampler
from backend.engine.scheduling.sched_output import ScheduledRequest
from backend.engine.sizing import MemoryProfile
from backend.engine.spec_decode.rejection_sampler import RejectionSampler, verify_rows
from backend.engine.runner.step_inputs import StepInputBuilder
from backend.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class DeviceMemory(Protocol):
    def info(self) -> tuple[int, int]: ...          # (free, total) bytes, from the driver
    def allocated(self) -> int: ...                 # bytes the allocator has handed out now
    def max_allocated(self) -> int: ...             # ... at most since reset_peak
    def reset_peak(self) -> None: ...
    def release(self) -> None: ...                  # wait for the device, return cached blocks


class CudaMemory:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def max_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def release(self) -> None:
        torch.cuda.synchronize(self.device)
        gc.collect()
        torch.cuda.empty_cache()


def measure(memory: DeviceMemory, setup: Callable[[], Callable[[], object]]) -> MemoryProfile:
    """setup() allocates what the step needs but a real step would not (its own small KV
    cache) and returns the step; the step runs between two readings of the allocator. Once
    everything is freed, the driver says what stays in use."""
    step = setup()
    memory.release()
    start = memory.allocated()
    memory.reset_peak()
    result = step()
    memory.release()
    peak = memory.max_allocated() - start
    del result, step
    memory.release()
    free, total = memory.info()
    return MemoryProfile(total=total, in_use=total - free, activation_peak=max(peak, 0))


def split_tokens(num_tokens: int, max_num_seqs: int) -> list[int]:
    """num_tokens over min(max_num_seqs, num_tokens) sequences, as evenly as possible."""
    n = max(1, min(max_num_seqs, num_tokens))
    return [num_tokens // n + (1 if i < num_tokens % n else 0) for i in range(n)]


def dummy_requests(lengths: list[int], num_rows: int, vocab_size: int, max_logprobs: int,
                   rng: np.random.Generator) -> list[RequestState]:
    """num_rows requests that use every sampler feature that costs memory; the first
    len(lengths) have prompts of those lengths, the rest one token; one output token each
    (frequency and presence penalties read generated tokens)."""
    params = SamplingParams(temperature=1.0, top_k=max(vocab_size - 1, 1), top_p=0.9,
                            repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1,
                            logprobs=max_logprobs if max_logprobs > 0 else None, max_tokens=1,
                            **{proc.name: proc.profile_value for proc in PROCESSORS})
    out = []
    for i in range(num_rows):
        n = lengths[i] if i < len(lengths) else 1
        out.append(RequestState(f"profile-{i}", rng.integers(0, vocab_size, n).tolist(), params, max_tokens=1,
                                output_token_ids=[int(rng.integers(0, vocab_size))]))
    return out


def prefill_step(model, args: EngineArgs, kv_dtype: torch.dtype, device: torch.device, vocab_size: int,
                 seed: int = 0) -> Callable[[], Callable[[], object]]:
    """The setup of the profile step for `measure` (see the module's docstring)."""
    def setup() -> Callable[[], object]:
        bs = args.block_size
        lengths = split_tokens(args.max_num_batched_tokens, args.max_num_seqs)
        tables: dict[str, list[int]] = {}
        first = 0
        for i, n in enumerate(lengths):
            k = -(-n // bs)
            tables[f"profile-{i}"] = list(range(first, first + k))
            first += k
        kv = allocate_kv_cache(model.config, first, bs, kv_dtype, device)
        inputs = StepInputBuilder(sum(lengths), len(lengths), max(len(t) for t in tables.values()), bs, device)
        rng = np.random.default_rng(seed)
        requests = dummy_requests(lengths, args.max_num_seqs, vocab_size, args.max_logprobs, rng)
        sampler = Sampler(seed, device, args.max_num_seqs)
        sampler.prepare(requests, vocab_size)       # grows the penalty tables (reserved apart)
        ids = [f"profile-{i}" for i in range(len(lengths))]
        n_new = np.asarray(lengths, dtype=np.int64)
        verifying = _verify_step(args.speculative_config, requests, vocab_size, device, rng)
        tree = args.speculative_config.token_tree if verifying else None
        rows = verify_rows(verifying, requests, tree) if verifying else requests
        rejection = RejectionSampler(device)

        @torch.inference_mode()
        def step() -> object:
            batch = sampler.prepare(rows, vocab_size)
            built = inputs.build_segments(ids, np.zeros(len(ids), dtype=np.int64), n_new,
                                          np.ones(len(ids), dtype=np.int64),
                                          lambda i, a, b: requests[i].prompt_token_ids[a:b], [tables[i] for i in ids])
            logits: Optional[torch.Tensor] = run_model(model, kv, built)
            if logits is None:                      # not rank 0: no sampler here
                return None
            if logits.shape[0] < len(rows):         # fewer tokens than sampled rows: sample them all
                logits = torch.cat([logits, logits.new_zeros(len(rows) - logits.shape[0], logits.shape[1])])
            if not verifying:
                return logprob_ops.pack(logits, sampler.sample(logits, batch), batch.logprobs)
            sampled, accepted = rejection.sample(sampler, logits, batch, rejection.plan(verifying, tree))
            return torch.cat([logprob_ops.pack(logits, sampled, batch.logprobs).float(), accepted.float()])
        return step
    return setup


def _verify_step(speculative_config, requests: list[RequestState], vocab_size: int, device: torch.device,
                 rng: np.random.Generator) -> list[ScheduledRequest]:
    """With speculation: every request verifying num_speculative_tokens random proposals,
    drawn from (random) draft distributions for a draft model or head, point masses for n-gram
    and for a tree's nodes (their acceptance needs no q). Empty without speculation."""
    if speculative_config is None:
        return []
    k = speculative_config.num_speculative_tokens
    probs = None
    if speculative_config.method != "ngram" and speculative_config.token_tree is None:
        probs = torch.rand(len(requests), k, vocab_size, device=device)
        probs /= probs.sum(dim=-1, keepdim=True)
    return [ScheduledRequest(None, k + 1, rng.integers(0, vocab_size, k).tolist(),
                             probs[i] if probs is not None else None, request_id=r.request_id)
            for i, r in enumerate(requests)]


def startup_snapshot(device: torch.device, memory: Optional[DeviceMemory] = None) -> tuple[int, int]:
    """(free, total) bytes before the engine loads anything: what is in use then belongs to
    others (other processes, other engines in this process; vLLM's init snapshot)."""
    memory = memory or CudaMemory(device)
    memory.release()
    return memory.info()


def profile_memory(model, args: EngineArgs, kv_dtype: torch.dtype, device: torch.device, vocab_size: int,
                   memory: Optional[DeviceMemory] = None) -> MemoryProfile:
    """The profile run on `device` (CUDA unless a test passes its own `memory`)."""
    profile = measure(memory or CudaMemory(device), prefill_step(model, args, kv_dtype, device, vocab_size))
    spec = args.speculative_config
    rows = args.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))
    logger.info("profile run (%d tokens over up to %d sequences, sampler at %d rows): peak activations "
                "%.1f MiB; %.2f of %.2f GiB in use after loading", args.max_num_batched_tokens,
                args.max_num_seqs, rows, profile.activation_peak / 2**20,
                profile.in_use / 2**30, profile.total / 2**30)
    return profile


def estimated_profile(cfg, args: EngineArgs, dtype_bytes: int, device: torch.device,
                      memory: Optional[DeviceMemory] = None) -> MemoryProfile:
    """Where no profile step can run on this rank alone (tensor parallelism, whose
    forward needs every rank; exported-graph runners): the driver's figures and an
    estimate of the activation peak, one layer's intermediates and the logits at
    max_num_batched_tokens rows (or a verify step's rows, if more) (backend/engine/cuda_graphs.estimate_graph_bytes), which
    overstates the logits (only the sampled rows have them)."""
    from backend.engine.runner.cuda_graphs import estimate_graph_bytes
    memory = memory or CudaMemory(device)
    memory.release()
    free, total = memory.info()
    spec = args.speculative_config
    rows = max(args.max_num_batched_tokens,
               args.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0)))
    peak = estimate_graph_bytes(cfg, rows, dtype_bytes)
    logger.info("no profile run on this runner; activation peak estimated at %.1f MiB", peak / 2**20)
    return MemoryProfile(total=total, in_use=total - free, activation_peak=peak, profiled=False)
