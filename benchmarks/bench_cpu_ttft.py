"""Time to first token on the CPU with the engine's steps in series (the CPU's default)
against scheduled a step ahead (`async_scheduling: true`, CUDA's default), the same
prompts in one run.

    python -m benchmarks.bench_cpu_ttft [--checkpoint PATH] [--num-prompts 40] [--busy 15]

Two cases, each on a fresh engine per mode:
- alone: each prompt (32-256 random tokens, greedy) on an idle engine, after a warm-up;
- busy: the same prompts, each arriving beside `--busy` requests that decode throughout.
A request's TTFT is from its `add_request` to the end of the `step()` that returns its
first token. Printed: p50 and p99 per mode and case, and in series over ahead.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from backend import LLM, SamplingParams
from benchmarks.bench_priority import DEFAULT_CHECKPOINT, percentile

MODES = {"in_series": False, "ahead": True}


def first_token_s(engine, prompt: list[int]) -> float:
    """One request's TTFT; it is aborted at its first token."""
    start = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)).request_id
    while True:
        if any(o.request_id == rid and o.new_token_ids for o in engine.step()):
            elapsed = time.perf_counter() - start
            engine.abort_request(rid)
            return elapsed


def measure(checkpoint: str, async_scheduling: bool, prompts: list[list[int]], busy: int,
            busy_tokens: int) -> list[float]:
    llm = LLM(checkpoint, max_num_seqs=busy + 1, max_num_batched_tokens=512, async_scheduling=async_scheduling)
    engine = llm.engine
    for _ in range(busy):                   # (decoding for the whole run)
        engine.add_request(prompts[0][:8], SamplingParams(max_tokens=busy_tokens, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    times = [first_token_s(engine, p) for p in prompts[:1] + prompts][1:]      # (after a warm-up)
    for request_id in list(engine.scheduler.requests):
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    kv = engine.kv_cache
    assert kv.num_free_blocks == kv.num_total_blocks, "blocks still held after every request ended"
    llm.close()
    return times


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_cpu_ttft")
    ap.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT)
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--busy", type=int, default=15, help="requests decoding beside each prompt in the busy case")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    with open(os.path.join(a.checkpoint, "config.json")) as f:
        config = json.load(f)
    vocab, busy_tokens = config["vocab_size"], config["max_position_embeddings"] - 16
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(32, 256))] for _ in range(a.num_prompts)]
    report = {}
    for case, busy in (("alone", 0), ("busy", a.busy)):
        for mode, async_scheduling in MODES.items():
            t = measure(a.checkpoint, async_scheduling, prompts, busy, busy_tokens)
            report[f"{case}_{mode}"] = {"p50_s": percentile(t, 0.5), "p99_s": percentile(t, 0.99)}
        s, h = report[f"{case}_in_series"], report[f"{case}_ahead"]
        print(f"{case:5s} TTFT p50 / p99: in series {s['p50_s'] * 1e3:6.1f} / {s['p99_s'] * 1e3:6.1f} ms, "
              f"ahead {h['p50_s'] * 1e3:6.1f} / {h['p99_s'] * 1e3:6.1f} ms (p50 {s['p50_s'] / h['p50_s']:.2f}x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
