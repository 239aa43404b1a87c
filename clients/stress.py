"""Overload and cancellation-storm stress test against a running tritonserver (loopback).

    python -m clients.stress --url 127.0.0.1:8001 --metrics-url http://127.0.0.1:8002/metrics \
        --streams 300 --concurrency 96

1. Reference: the survivor prompts, alone, greedy.
2. Storm: `--streams` requests at `--concurrency`; half of them are cancelled at a random
   moment (stop_stream(cancel_requests=True)) or belong to client processes that are
   SIGKILLed mid-stream; the rest (survivors) must produce exactly the reference output.
3. Afterwards the KV pool must be fully free (llm_kv_cache_blocks_used == 0).
Bounded in count and time; talks only to the given loopback addresses.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import re
import signal
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Optional

from clients.triton_client import StreamingRequest

WORDS = ("assert pass del return yield raise break continue import global nonlocal if while for try with "
         "class def lambda async await match case").split()


@dataclass
class StressReport:
    streams: int
    concurrency: int
    completed: int
    cancelled: int
    killed_clients: int
    killed_streams: int
    rejected: int
    survivors_checked: int
    survivors_mismatched: int
    preemptions: float
    leaked_blocks: float
    peak_rss_mb: float
    duration_s: float


def scrape(metrics_url: str, name: str, labels: str = "") -> float:
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        text = r.read().decode()
    pat = rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$"
    m = re.search(pat, text, re.M)
    return float(m.group(1)) if m else float("nan")


def _prompt(i: int) -> str:
    rng = random.Random(i)
    return "The " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))


def _killable_client(url: str, prompts: list[str], max_tokens: int) -> None:
    """Runs in a child process that the parent SIGKILLs mid-stream."""
    params = {"max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 0}
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda p: StreamingRequest(url).run(p, params, timeout_s=120), prompts))


def server_rss_mb() -> float:
    """Resident memory of tritonserver and its python stubs on this machine (MB)."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
            if comm.startswith("tritonserver") or comm.startswith("triton_python"):
                with open(f"/proc/{pid}/statm") as f:
                    total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            continue
    return total / 2**20


def run_stress(url: str, metrics_url: str, streams: int = 300, concurrency: int = 96, max_tokens: int = 32,
               killed_clients: int = 4, streams_per_killed_client: int = 8, seed: int = 0,
               time_limit_s: float = 600.0) -> StressReport:
    rng = random.Random(seed)
    greedy = {"max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 0}
    roles = ["survive"] * (streams - streams // 2) + ["cancel"] * (streams // 2)
    rng.shuffle(roles)
    survivors = [i for i, r in enumerate(roles) if r == "survive"]
    # Reference outputs, without the storm (a few at a time).
    with ThreadPoolExecutor(8) as pool:
        refs = dict(zip(survivors, pool.map(lambda i: StreamingRequest(url).run(_prompt(i), greedy).token_ids,
                                            survivors)))
    preempt_before = scrape(metrics_url, "vllm:num_preemptions_total")
    t0 = time.monotonic()
    deadline = t0 + time_limit_s
    peak_rss = server_rss_mb()

    ctx = mp.get_context("spawn")
    procs = []
    for k in range(killed_clients):
        p = ctx.Process(target=_killable_client, daemon=True,
                        args=(url, [_prompt(10_000 + k * 100 + j) for j in range(streams_per_killed_client)],
                              max_tokens * 4))
        p.start()
        procs.append(p)

    def one(i: int):
        if time.monotonic() > deadline:
            return i, None
        cancel_after = rng.randint(1, max_tokens - 1) if roles[i] == "cancel" else None
        return i, StreamingRequest(url).run(_prompt(i), greedy, cancel_after=cancel_after, timeout_s=300)

    results = {}
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(one, i) for i in range(streams)]
        time.sleep(1.0)
        for p in procs:  # kill the client processes while their streams are open
            time.sleep(rng.uniform(0.1, 0.5))
            os.kill(p.pid, signal.SIGKILL)
        for f in futures:
            i, res = f.result()
            results[i] = res
            peak_rss = max(peak_rss, server_rss_mb())

    # Blocks come back within an engine step of each cancellation; allow a moment.
    leaked = float("nan")
    for _ in range(100):
        leaked = scrape(metrics_url, "llm_kv_cache_blocks_used")
        busy = scrape(metrics_url, "vllm:num_requests_running") + scrape(metrics_url, "vllm:num_requests_waiting")
        if leaked == 0 and busy == 0:
            break
        time.sleep(0.1)
    done = [r for r in results.values() if r is not None]
    mismatched = sum(1 for i in survivors if results.get(i) is not None and results[i].ok
                     and results[i].token_ids != refs[i])
    failed_survivors = sum(1 for i in survivors if results.get(i) is None or not results[i].ok)
    return StressReport(
        streams=streams, concurrency=concurrency,
        completed=sum(1 for r in done if r.ok),
        cancelled=sum(1 for r in done if r.cancelled),
        killed_clients=len(procs), killed_streams=len(procs) * streams_per_killed_client,
        rejected=sum(1 for r in done if r.error),
        survivors_checked=len(survivors) - failed_survivors,
        survivors_mismatched=mismatched + failed_survivors,
        preemptions=scrape(metrics_url, "vllm:num_preemptions_total") - preempt_before,
        leaked_blocks=leaked, peak_rss_mb=round(peak_rss, 1), duration_s=round(time.monotonic() - t0, 1))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clients.stress", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="127.0.0.1:8001")
    ap.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics")
    ap.add_argument("--streams", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--killed-clients", type=int, default=4)
    ap.add_argument("--time-limit-s", type=float, default=600)
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    for host in (args.url, args.metrics_url):
        if not re.search(r"(127\.\d+\.\d+\.\d+|localhost|\[::1\])", host):
            ap.error("stress traffic goes to loopback addresses only")
    report = run_stress(args.url, args.metrics_url, args.streams, args.concurrency, args.max_tokens,
                        args.killed_clients, time_limit_s=args.time_limit_s)
    print(json.dumps(asdict(report), indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report), f, indent=2)
    return 0 if report.leaked_blocks == 0 and report.survivors_mismatched == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
