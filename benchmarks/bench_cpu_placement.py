"""Where a CPU step runs (backend/engine/runner/cpu_shards.py), each placement timed on
the same steps, alternating, in one process:

    python -m benchmarks.bench_cpu_placement [--checkpoint PATH] [--repeats 3]
        [--prompt-lens 64 128 256 512] [--rows 16 32 64] [--contexts 64 300]

1. A prompt's first step beside 15 decode rows (contexts 100-300), for prompts of 64 to
   512 tokens: whole on both intra-op threads against split by sequences (the prompt's
   shard then runs on one thread). The engine's rule: whole when one shard would hold
   over MAX_SHARD_SHARE of the work.
2. Decode-only steps of 16 to 64 rows at contexts 64 and 300: split against whole on
   the engine's thread with one shard's intra-op threads (one on 2 cores). The engine's
   rule: split past MIN_SHARD_WORK a shard.

The "core taken" rule is off throughout (CONTENDED_EFFICIENCY 0) and every measured step
counts as worth splitting, so each placement is the one asked for. Prints the median step of each (ms).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from backend import LLM, SamplingParams
from backend.engine.runner import cpu_shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CHECKPOINT = os.path.join(ROOT, "model_repository", "llm", "checkpoint")


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True)


def timed_steps(engine, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def drain(engine, ids) -> None:
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


def prompt_beside_decodes(engine, rng, vocab: int, prompt_len: int) -> list[float]:
    """The first step of a prompt of prompt_len tokens joining 15 decoding requests."""
    ids = [engine.add_request([rng.randrange(3, vocab) for _ in range(rng.randint(100, 300))],
                              params(400)).request_id for _ in range(15)]
    timed_steps(engine, 8)                      # their prompts done: decoding
    times = []
    shards = engine.runner.shards
    for _ in range(5):
        rid = engine.add_request([rng.randrange(3, vocab) for _ in range(prompt_len)], params(2)).request_id
        # (a step under the split's minimum work would run whole on one thread either way)
        min_cost, shards.min_cost = shards.min_cost, 0.0
        times += timed_steps(engine, 1)
        shards.min_cost = min_cost
        engine.abort_request(rid)
        engine.step()
    drain(engine, ids)
    return times


def decode_only(engine, shards, rng, vocab: int, rows: int, context: int) -> dict[str, list[float]]:
    ids = [engine.add_request([rng.randrange(3, vocab) for _ in range(context)], params(400)).request_id
           for _ in range(rows)]
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    out: dict[str, list[float]] = {"split": [], "whole, one thread": []}
    min_cost, shards.min_cost = shards.min_cost, 0.0        # (split whatever the step's work)
    for placement in ("split", "whole, one thread") * 2:
        # (the "core taken" path: whole on the engine's thread with one shard's threads)
        shards.whole_steps_left = 10 ** 9 if placement != "split" else 0
        out[placement] += timed_steps(engine, 6)
    shards.whole_steps_left, shards.min_cost = 0, min_cost
    drain(engine, ids)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_cpu_placement")
    ap.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 300])
    a = ap.parse_args(argv)
    cpu_shards.CONTENDED_EFFICIENCY = 0.0
    llm = LLM(a.checkpoint, max_num_seqs=128, max_num_batched_tokens=2048, num_kv_blocks=4000, seed=0)
    engine = llm.engine
    shards = engine.runner.shards
    if shards is None:
        raise SystemExit("the forward is not split on this machine (cpu_forward_shards): nothing to compare")
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    share = cpu_shards.MAX_SHARD_SHARE
    beside: dict[tuple[int, str], list[float]] = {}
    decodes: dict[tuple[int, int, str], list[float]] = {}
    for _ in range(a.repeats):
        for prompt_len in a.prompt_lens:
            for placement, value in (("whole, 2 threads", 0.0), ("split", 1.01)):
                cpu_shards.MAX_SHARD_SHARE = value
                beside.setdefault((prompt_len, placement), []).extend(
                    prompt_beside_decodes(engine, rng, vocab, prompt_len))
        cpu_shards.MAX_SHARD_SHARE = share
        for rows in a.rows:
            for context in a.contexts:
                for placement, times in decode_only(engine, shards, rng, vocab, rows, context).items():
                    decodes.setdefault((rows, context, placement), []).extend(times)
    llm.close()
    ms = lambda v: f"{statistics.median(v) * 1e3:6.2f} ms"      # noqa: E731
    print("# a prompt's first step beside 15 decode rows (median step)")
    for prompt_len in a.prompt_lens:
        print(f"prompt {prompt_len:4d}: whole, 2 threads {ms(beside[(prompt_len, 'whole, 2 threads')])}, "
              f"split {ms(beside[(prompt_len, 'split')])}")
    print("# decode-only steps (median step)")
    for rows in a.rows:
        for context in a.contexts:
            print(f"{rows:3d} rows x {context:3d}: split {ms(decodes[(rows, context, 'split')])}, "
                  f"whole, one thread {ms(decodes[(rows, context, 'whole, one thread')])}")


if __name__ == "__main__":
    main()
