"""Structured output under slow-grammar attack (issue 49 item 9): how long a normal
grammar waits to compile while six tiny schemas that compile for minutes are in flight,
with the compile pool's two lanes and with one lane (as before), side by side in one run.

    python -m benchmarks.bench_grammar_lockout [--checkpoint PATH] [--trials 20] [--compile-timeout-s 10] [--json out.json]

The engine's grammar compiler (`StructuredOutput`, its worker threads and processes) on
the checkpoint's tokenizer, without a model. For each phase: the normal grammars' compile
time alone (a JSON schema of a few fields and a regex, each new: the cache is bypassed
by a varying field name), then the same after six slow schemas (`(e|f){1,16000+i}`) were
submitted; each slow one is given up on (its process killed) `--compile-timeout-s` after
it started, as the engine does at `guided_compile_timeout_s` (default 10 s). A compile's
time runs from submit to its compiled grammar. Phases: "two lanes"
(the default: a compile past FAST_COMPILE_S moves to the slow lane) and "one lane"
(`fast_s` off: the pool as before issue 49's fix). Printed: p50 and max per phase.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import torch

from backend.engine.structured_output import grammar
from backend.sampling_params import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CHECKPOINT = os.path.join(ROOT, "model_repository", "llm", "checkpoint")


def normal(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(guided_regex=f"[0-9]{{{i % 7 + 1}}}-[a-z]+{i}")
    return SamplingParams(guided_json={"type": "object", "properties": {
        f"name{i}": {"type": "string"}, "age": {"type": "integer"}}, "required": [f"name{i}"]})


def slow(i: int) -> SamplingParams:
    return SamplingParams(guided_json={"type": "string", "pattern": f"(e|f){{1,{16000 + i}}}"})


def compile_times(so, params: list[SamplingParams]) -> list[float]:
    times = []
    for p in params:
        start = time.perf_counter()
        so.compile(p).future.result(120)
        times.append(time.perf_counter() - start)
    return times


def time_limit(pool, jobs, timeout_s: float, stop: threading.Event) -> None:
    """What the engine does at guided_compile_timeout_s: a compile that has run that long
    since it started is given up on (its process killed)."""
    while not stop.wait(0.01):
        now = time.monotonic()
        for job in jobs:
            if job.started is not None and now - job.started >= timeout_s:
                pool.abandon(job)


def phase(tokenizer, vocab_size: int, trials: int, two_lanes: bool, offset: int, timeout_s: float) -> dict:
    saved = grammar.FAST_COMPILE_S
    if not two_lanes:
        grammar.FAST_COMPILE_S = None
    try:
        so = grammar.StructuredOutput(tokenizer, vocab_size, torch.device("cpu"), 4)
    finally:
        grammar.FAST_COMPILE_S = saved
    try:
        compile_times(so, [normal(offset - 1)])                       # processes started
        alone = compile_times(so, [normal(offset + i) for i in range(trials)])
        attack = [so.compile(slow(offset + i)) for i in range(6)]
        stop = threading.Event()
        limit = threading.Thread(target=time_limit, args=(so.pool, attack, timeout_s, stop), daemon=True)
        limit.start()
        time.sleep(0.2)
        loaded = compile_times(so, [normal(offset + trials + i) for i in range(trials)])
        stop.set()
        limit.join()
        for job in attack:
            so.pool.abandon(job)
    finally:
        so.close()
    return {"alone": summary(alone), "under_attack": summary(loaded)}


def summary(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"p50_ms": 1e3 * ordered[len(ordered) // 2], "max_ms": 1e3 * ordered[-1], "n": len(times)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_grammar_lockout")
    ap.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--compile-timeout-s", type=float, default=10.0,
                    help="the engine's guided_compile_timeout_s, applied to the slow schemas")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    from transformers import AutoConfig, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(a.checkpoint)
    vocab_size = AutoConfig.from_pretrained(a.checkpoint).vocab_size
    report = {"fast_compile_s": grammar.FAST_COMPILE_S, "compile_threads": grammar.COMPILE_THREADS,
              "slow_compile_threads": grammar.SLOW_COMPILE_THREADS}
    print(f"# {a.trials} normal grammars, alone then behind six slow schemas; fast lane limit "
          f"{grammar.FAST_COMPILE_S * 1e3:.0f} ms, {grammar.COMPILE_THREADS} fast + "
          f"{grammar.SLOW_COMPILE_THREADS} slow threads")
    for name, two_lanes, offset in (("two lanes", True, 0), ("one lane", False, 1000)):
        r = report[name] = phase(tokenizer, vocab_size, a.trials, two_lanes, offset, a.compile_timeout_s)
        print(f"{name:9s}: alone p50 {r['alone']['p50_ms']:7.1f} ms, max {r['alone']['max_ms']:7.1f} ms; "
              f"behind six slow schemas p50 {r['under_attack']['p50_ms']:7.1f} ms, "
              f"max {r['under_attack']['max_ms']:7.1f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
