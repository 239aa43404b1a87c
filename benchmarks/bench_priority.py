"""Priority scheduling under saturation (issue 54): the high-priority class's time to
first token against an idle engine's, with FCFS beside it in the same run.

    python -m benchmarks.bench_priority [--checkpoint PATH] [--num-requests 300] [--high-fraction 0.1]
        [--load 1.5] [--max-num-seqs 16] [--json out.json]

One process, the offline engine (`backend.LLM`) driven step by step here. Requests
arrive as a Poisson process at `--load` times the engine's own throughput in requests
per second (measured first, FCFS, all requests at once), so the queue grows for the whole
run; `--high-fraction` of them have priority 0, the rest 1; prompts and output lengths
are random (seeded, greedy, EOS ignored). The same arrivals run under
`scheduling_policy` fcfs (every priority 0) and priority. A request's TTFT is from its
arrival to the end of the step that returns its first token. The idle TTFT is one
request alone on a fresh engine (median of 5); each phase runs on an engine of its own
(no prefix-cache hits from another). Printed per policy: each class's TTFT
p50/p99, how many completed, and the high class's p99 over the idle TTFT.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
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


def idle_ttft(llm: LLM, requests) -> float:
    times = []
    for prompt, n, _ in requests[:5]:
        engine = llm.engine
        start = time.perf_counter()
        rid = engine.add_request(prompt, params(n, 0)).request_id
        while True:
            outs = {o.request_id: o for o in engine.step()}
            if rid in outs and outs[rid].new_token_ids:     # (token_ids is filled in on the final output)
                times.append(time.perf_counter() - start)
                break
        while engine.has_unfinished_requests():
            engine.step()
    return statistics.median(times)


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
    ap.add_argument("--num-requests", type=int, default=300)
    ap.add_argument("--high-fraction", type=float, default=0.1)
    ap.add_argument("--load", type=float, default=1.5, help="arrival rate over the measured throughput")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-kv-blocks", type=int, help="the engine's pool (default: the engine's own sizing)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    kw = dict(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=512, seed=a.seed,
              **({"num_kv_blocks": a.num_kv_blocks} if a.num_kv_blocks else {}))

    def fresh(policy: str = "fcfs") -> LLM:
        # Each phase on an engine of its own: no prefix-cache hit from an earlier phase.
        return LLM(a.checkpoint, scheduling_policy=policy, **kw)
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
    idle = idle_ttft(llm, [r for r in requests if r[2]] or requests)
    llm.close()
    report = {"throughput_rps": rps, "arrival_rps": a.load * rps, "idle_ttft_s": idle}
    for policy in ("fcfs", "priority"):
        llm = fresh(policy)
        report[policy] = saturated(llm, requests, arrivals, policy)
        llm.close()
    print(f"# {a.num_requests} requests, {a.high_fraction:.0%} high priority, arrivals {a.load}x the measured "
          f"{rps:.2f} req/s, max_num_seqs {a.max_num_seqs}; idle TTFT {idle * 1e3:.0f} ms")
    for policy in ("fcfs", "priority"):
        r = report[policy]
        print(f"{policy:9s} high: TTFT p50 {r['high']['ttft_p50_s'] * 1e3:8.0f} ms, p99 {r['high']['ttft_p99_s'] * 1e3:8.0f} "
              f"ms ({r['high']['ttft_p99_s'] / idle:.1f}x idle), {r['high']['completed']}/{r['high']['requests']} done; "
              f"low: p50 {r['low']['ttft_p50_s'] * 1e3:8.0f} ms, p99 {r['low']['ttft_p99_s'] * 1e3:8.0f} ms, "
              f"{r['low']['completed']}/{r['low']['requests']} done; {r['seconds']:.1f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
