"""Offline throughput and engine-level figures, in one process run.

The engine against Hugging Face transformers on the same checkpoint, prompts and output
lengths (EOS ignored, min_tokens = max_tokens), plus KV utilization, concurrency at a
fixed KV budget vs contiguous preallocation, prefix caching on vs off, and in-flight vs
static batching.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from backend import LLM, SamplingParams
from backend.engine.scheduling.sched_output import SchedulerOutput
from backend.engine.scheduling.scheduler import Scheduler


@dataclass(frozen=True)
class Workload:
    """nano-vllm's benchmark shape: random token ids, lengths uniform in ranges."""
    prompts: tuple[tuple[int, ...], ...]
    output_lens: tuple[int, ...]

    @classmethod
    def random(cls, num_seqs: int, input_range: tuple[int, int], output_range: tuple[int, int],
               vocab_size: int, seed: int = 0) -> "Workload":
        rng = random.Random(seed)
        prompts = tuple(tuple(rng.randrange(3, vocab_size) for _ in range(rng.randint(*input_range)))
                        for _ in range(num_seqs))
        outs = tuple(rng.randint(*output_range) for _ in range(num_seqs))
        return cls(prompts, outs)

    @classmethod
    def bimodal(cls, num_seqs: int, input_range: tuple[int, int], short_range: tuple[int, int],
                long_range: tuple[int, int], long_fraction: float, vocab_size: int, seed: int = 0) -> "Workload":
        """Widely varying output lengths: mostly short answers, a few long ones."""
        rng = random.Random(seed)
        prompts = tuple(tuple(rng.randrange(3, vocab_size) for _ in range(rng.randint(*input_range)))
                        for _ in range(num_seqs))
        outs = tuple(rng.randint(*(long_range if rng.random() < long_fraction else short_range))
                     for _ in range(num_seqs))
        return cls(prompts, outs)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def params(self) -> list[SamplingParams]:
        return [SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True) for n in self.output_lens]


@dataclass
class RunResult:
    name: str
    seconds: float
    output_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def run_engine(path: str, wl: Workload, name: str = "engine", static_batching: bool = False,
               **engine_args) -> tuple[RunResult, LLM]:
    llm = LLM(path, **engine_args)
    if static_batching:
        llm.engine.scheduler.__class__ = StaticBatchScheduler       # same state, other admission
    llm.generate([list(wl.prompts[0][:8])], SamplingParams(max_tokens=2))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([list(p) for p in wl.prompts], wl.params())
    dt = time.perf_counter() - t0
    produced = sum(len(o.token_ids) for o in outs)
    assert produced == wl.num_output_tokens, (produced, wl.num_output_tokens)
    return RunResult(name, dt, produced), llm


def _hf_model(path: str, attn: str):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.set_attn_implementation(attn)
    return model


@torch.no_grad()
def run_hf_static(path: str, wl: Workload, batch_size: int) -> RunResult:
    """Peer 1: padded static batching with generate(): batches in arrival order, each runs
    until its longest request is done; only the requested tokens count."""
    model = _hf_model(path, "sdpa")
    pad = 0
    t0 = time.perf_counter()
    for start in range(0, len(wl.prompts), batch_size):
        prompts = wl.prompts[start:start + batch_size]
        n_new = max(wl.output_lens[start:start + batch_size])
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        model.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                       pad_token_id=pad)
    return RunResult(f"hf generate (static, batch {batch_size})", time.perf_counter() - t0, wl.num_output_tokens)


@torch.no_grad()
def run_hf_continuous(path: str, wl: Workload, max_batch_tokens: Optional[int] = None,
                      num_blocks: Optional[int] = None) -> RunResult:
    """Peer 2: transformers' own continuous batching with paged attention."""
    from transformers import GenerationConfig
    model = _hf_model(path, "paged|sdpa")
    cfg = GenerationConfig(max_new_tokens=max(wl.output_lens), do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    kwargs = {}
    if max_batch_tokens or num_blocks:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens,
                                                                        num_blocks=num_blocks)
    produced = 0
    with model.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=5, **kwargs) as mgr:
        t0 = time.perf_counter()  # the manager's start-up (warm-up) is not counted
        ids = [mgr.add_request(list(p), max_new_tokens=n, eos_token_id=-1) for p, n in zip(wl.prompts, wl.output_lens)]
        done = 0
        while done < len(ids):
            r = mgr.get_result(timeout=1)
            if r is not None and r.is_finished():
                done += 1
                produced += len(r.generated_tokens)
    return RunResult("hf generate_batch (continuous, paged)", time.perf_counter() - t0, produced)


# ------------------------------------------------------------------ engine figures
def kv_utilization(path: str, wl: Workload, **engine_args) -> dict:
    """Live tokens / allocated slots, sampled every step while the batch is full."""
    llm = LLM(path, **engine_args)
    eng = llm.engine
    for p, sp in zip(wl.prompts, wl.params()):
        eng.add_request(list(p), sp)
    samples, peak_seqs = [], 0
    while eng.has_unfinished_requests():
        eng.step()
        running = eng.scheduler.running
        peak_seqs = max(peak_seqs, len(running))
        if eng.scheduler.waiting and running:  # steady state: demand exceeds what fits
            live = sum(r.num_computed_tokens for r in running)
            slots = sum(len(eng.kv_cache.req_blocks.get(r.request_id, ())) for r in running) * eng.args.block_size
            if slots:
                samples.append(live / slots)
    return {"kv_utilization_mean": statistics.mean(samples) if samples else float("nan"),
            "steps_sampled": len(samples), "peak_concurrent_seqs": peak_seqs}


def concurrency_vs_contiguous(wl: Workload, num_kv_tokens: int, max_model_len: int, block_size: int) -> dict:
    """From the same trace: sequences that fit a KV budget when each is preallocated
    contiguously for max_model_len (static allocators) vs paged blocks covering its
    actual final length."""
    contiguous = num_kv_tokens // max_model_len
    need_blocks = sorted(-(-(len(p) + n) // block_size) for p, n in zip(wl.prompts, wl.output_lens))
    budget, paged = num_kv_tokens // block_size, 0
    for b in need_blocks:  # how many of the trace's sequences fit at once, smallest first
        if budget < b:
            break
        budget -= b
        paged += 1
    mean_len = statistics.mean(len(p) + n for p, n in zip(wl.prompts, wl.output_lens))
    return {"contiguous_seqs": contiguous, "paged_seqs_smallest_first": paged,
            "paged_seqs_at_mean_len": int(num_kv_tokens // (block_size * -(-mean_len // block_size))),
            "mean_seq_len": mean_len}


def shared_prefix(path: str, num_requests: int, prefix_len: int, suffix_len: int, output_len: int,
                  vocab: int, **engine_args) -> dict:
    """Requests sharing one long system prompt, arriving one after another; TTFT with
    prefix caching on vs off."""
    rng = random.Random(1)
    prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randrange(3, vocab) for _ in range(suffix_len)] for _ in range(num_requests)]
    out = {}
    for caching in (False, True):
        llm = LLM(path, enable_prefix_caching=caching, **engine_args)
        eng = llm.engine
        llm.generate([prompts[0][:4]], SamplingParams(max_tokens=1))  # warm-up, no shared prefix
        ttfts = []
        for p in prompts:
            t0 = time.perf_counter()
            req = eng.add_request(p, SamplingParams(max_tokens=output_len, min_tokens=output_len, temperature=0))
            first = None
            while eng.has_unfinished_requests():
                eng.step()
                if first is None and req.output_token_ids:
                    first = time.perf_counter() - t0
            ttfts.append(first)
        stats = llm.stats()
        out["on" if caching else "off"] = {
            "ttft_mean_s": statistics.mean(ttfts),
            "hit_rate": stats["prefix_cache_hit_tokens"] / max(stats["prefix_cache_queries"], 1),
        }
    out["ttft_speedup"] = out["off"]["ttft_mean_s"] / out["on"]["ttft_mean_s"]
    return out


class StaticBatchScheduler(Scheduler):
    """For the comparison only: admits a batch when nothing runs and then waits until all
    of it finishes (running requests still go first, and may be preempted)."""

    def schedule(self) -> SchedulerOutput:
        if not self.running:
            return super().schedule()
        waiting, self.waiting = self.waiting, deque()       # nothing is admitted
        try:
            return super().schedule()
        finally:
            self.waiting.extend(waiting)                   # after any preempted this step


def static_vs_inflight(path: str, wl: Workload, **engine_args) -> dict:
    inflight, _ = run_engine(path, wl, "engine (in-flight)", **engine_args)
    static, _ = run_engine(path, wl, "engine (static batching)", static_batching=True, **engine_args)
    return {"inflight_tok_s": inflight.tokens_per_s, "static_tok_s": static.tokens_per_s,
            "ratio": inflight.tokens_per_s / static.tokens_per_s}
