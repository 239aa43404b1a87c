"""Priority scheduling under saturation (issue 54): the high-priority class's time to
first token against an idle engine's, with FCFS beside it in the same run.

    python -m benchmarks.bench_priority [--checkpoint PATH] [--num-requests 1000] [--high-fraction 0.1]
        [--load 1.5] [--max-num-seqs 16] [--lower-priority-prefill-tokens 128] [--json out.json]

One process, the offline engine (`backend.LLM`) driven step by step here. Requests
arrive as a Poisson process at `--load` times the engine's own throughput in requests
per second (measured first, FCFS, all requests at once), so the queue grows for the whole
run; `--high-fraction` of them have priority 0, the rest 1; prompts and output lengths
are random (seeded, greedy, EOS ignored). The same arrivals run under
`scheduling_policy` fcfs (every priority 0), priority, and priority with the engine
argument `lower_priority_prefill_tokens` (`--lower-priority-prefill-tokens`, default 128:
lower-ranked prompts get at most that many tokens a step while better-ranked work is
present). A request's TTFT is from its
arrival to the end of the step that returns its first token. The idle TTFT: each
high-priority request alone on a fresh engine (after a warm-up request), its p50 and p99;
each phase runs on an engine of its own (no prefix-cache hits from another). Printed per
policy: each class's TTFT p50/p99, how many completed, and the high class's p99 over the
idle p99 (the issue's measure) and over the idle p50. Every engine keeps its defaults
otherwise: on the CPU its steps run in series (`async_scheduling` unset), idle and loaded
alike.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from backend import LLM, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CHECKPOINT = os.path.join(ROOT, "model_repository", "llm", "checkpoint")


def workload(n: int, high_fraction: float, vocab: int, seed: int) -> list[tuple[list[int], int, bool]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(32, 256))], rng.randint(16, 128),
             rng.random() < high_fraction) for _ in range(n)]


def params(out_len: int, priority: int) -> SamplingParams:
    return SamplingParams(max_tokens=out_len, min_tokens=out_len, temperature=0, ignore_eos=True, priority=priority)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def throughput_rps(llm: LLM, requests) -> float:
    start = time.perf_counter()
    llm.generate([p for p, _, _ in requests], [params(n, 0) for _, n, _ in requests])
    return len(requests) / (time.perf_counter() - start)


def idle_ttfts(llm: LLM, requests) -> list[float]:
    """Each request alone on the engine, after one warm-up request: its TTFT (the
    request is aborted once its first token is in)."""
    engine = llm.engine
    times = []
    for prompt, n, _ in requests[:1] + requests:
        start = time.perf_counter()
        rid = engine.add_request(prompt, params(n, 0)).request_id
        while True:
            outs = {o.request_id: o for o in engine.step()}
            if rid in outs and outs[rid].new_token_ids:     # (token_ids is filled in on the final output)
                times.append(time.perf_counter() - start)
                break
        engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
    return times[1:]


def saturated(llm: LLM, requests, arrivals: list[float], policy: str) -> dict:
    engine = llm.engine
    pending = list(zip(arrivals, requests))
    arrive, high, first, done = {}, {}, {}, set()
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            at, (prompt, n, is_high) = pending.pop(0)
            priority = 0 if policy == "fcfs" or is_high else 1
            rid = engine.add_request(prompt, params(n, priority)).request_id
            arrive[rid], high[rid] = t0 + at, is_high
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - t0)))
            continue
        outs = engine.step()
        t = time.perf_counter()
        for o in outs:
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = t - arrive[o.request_id]
            if o.finished:
                done.add(o.request_id)
    out = {}
    for name, want in (("high", True), ("low", False)):
        ttft = [first[r] for r in first if high[r] == want]
        out[name] = {"requests": sum(1 for r in high if high[r] == want),
                     "completed": sum(1 for r in done if high[r] == want),
                     "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99)}
    out["seconds"] = time.perf_counter() - t0
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_priority")
    ap.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT)
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--high-fraction", type=float, default=0.1)
    ap.add_argument("--load", type=float, default=1.5, help="arrival rate over the measured throughput")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-kv-blocks", type=int, help="the engine's pool (default: the engine's own sizing)")
    ap.add_argument("--lower-priority-prefill-tokens", type=int, default=128,
                    help="the engine argument in the third phase (a quarter of the step's 512 tokens)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    kw = dict(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=512, seed=a.seed,
              **({"num_kv_blocks": a.num_kv_blocks} if a.num_kv_blocks else {}))

    def fresh(policy: str = "fcfs", **extra) -> LLM:
        # Each phase on an engine of its own: no prefix-cache hit from an earlier phase.
        return LLM(a.checkpoint, scheduling_policy=policy, **kw, **extra)
    llm = fresh()
    vocab = llm.engine.model_config.vocab_size
    requests = workload(a.num_requests, a.high_fraction, vocab, a.seed)
    # (calibrated on prompts of its own, from another seed: none of the measured ones)
    rps = throughput_rps(llm, workload(48, 0.0, vocab, a.seed + 1000))
    llm.close()
    rng = random.Random(a.seed + 1)
    arrivals, t = [], 0.0
    for _ in requests:
        t += rng.expovariate(a.load * rps)
        arrivals.append(t)
    llm = fresh()
    idle = idle_ttfts(llm, [r for r in requests if r[2]] or requests)
    llm.close()
    report = {"throughput_rps": rps, "arrival_rps": a.load * rps,
              "idle_ttft_p50_s": percentile(idle, 0.5), "idle_ttft_p99_s": percentile(idle, 0.99)}
    phases = {"fcfs": ("fcfs", {}), "priority": ("priority", {}),
              "priority+cap": ("priority", {"lower_priority_prefill_tokens": a.lower_priority_prefill_tokens})}
    for name, (policy, extra) in phases.items():
        llm = fresh(policy, **extra)
        report[name] = saturated(llm, requests, arrivals, policy)
        llm.close()
    idle_p50, idle_p99 = report["idle_ttft_p50_s"], report["idle_ttft_p99_s"]
    print(f"# {a.num_requests} requests, {a.high_fraction:.0%} high priority, arrivals {a.load}x the measured "
          f"{rps:.2f} req/s, max_num_seqs {a.max_num_seqs}; the high requests alone: TTFT p50 "
          f"{idle_p50 * 1e3:.0f} ms, p99 {idle_p99 * 1e3:.0f} ms")
    print(f"# priority+cap: lower_priority_prefill_tokens={a.lower_priority_prefill_tokens}")
    for policy in phases:
        r = report[policy]
        p99 = r['high']['ttft_p99_s']
        print(f"{policy:12s} high: TTFT p50 {r['high']['ttft_p50_s'] * 1e3:8.0f} ms, p99 {p99 * 1e3:8.0f} "
              f"ms ({p99 / idle_p99:.1f}x the idle p99, {p99 / idle_p50:.1f}x the idle p50), "
              f"{r['high']['completed']}/{r['high']['requests']} done; "
              f"low: p50 {r['low']['ttft_p50_s'] * 1e3:8.0f} ms, p99 {r['low']['ttft_p99_s'] * 1e3:8.0f} ms, "
              f"{r['low']['completed']}/{r['low']['requests']} done; {r['seconds']:.1f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
