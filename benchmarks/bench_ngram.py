"""Host cost of prompt lookup (n-gram speculation) per decode step, by context length:
the proposer's incremental index against the exact scan over every token, side by side
in one run.

    python -m benchmarks.bench_ngram [--num-seqs 256 --contexts 240 1920 16384 --steps 40]

Each of `num_seqs` requests holds `context` random tokens (vocabulary 32,000, with a
copied stretch so that long matches occur). A step appends one token to every request
and proposes k tokens for each: `index` extends each request's NgramIndex by the new
token and looks up (what NgramProposer does), `scan` compares the newest token against
the whole sequence (the proposer before the index). Prints the median ms per step of
each and, for the index, the one-time cost of indexing the prompts (at admission).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from backend.engine.spec_decode.ngram_index import NgramIndex, lookup


def run(num_seqs: int, context: int, steps: int, n_min: int, n_max: int, k: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    seqs = rng.integers(0, 32_000, (num_seqs, context + steps)).astype(np.int32)
    half, quote = context // 2, min(32, context // 4)
    seqs[:, half:half + quote] = seqs[:, :quote]    # a quoted stretch
    t0 = time.perf_counter()
    indexes = []
    for row in seqs:
        index = NgramIndex(n_min, n_max)
        index.update(row[:context])
        indexes.append(index)
    build_ms = (time.perf_counter() - t0) * 1e3
    index_ms, scan_ms = [], []
    for s in range(steps):
        L = context + s + 1
        t0 = time.perf_counter()
        by_index = []
        for row, index in zip(seqs, indexes):
            index.update(row[:L])
            by_index.append(index.lookup(row[:L], k))
        t1 = time.perf_counter()
        by_scan = [lookup(row[:L], n_min, n_max, k) for row in seqs]
        t2 = time.perf_counter()
        if by_index != by_scan:
            raise AssertionError(f"the index and the scan proposed differently at {L} tokens")
        index_ms.append((t1 - t0) * 1e3)
        scan_ms.append((t2 - t1) * 1e3)
    return dict(context=context, index_ms=statistics.median(index_ms), scan_ms=statistics.median(scan_ms),
                build_ms=build_ms)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_ngram", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--contexts", type=int, nargs="+", default=[240, 1920, 16384])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=5)
    ap.add_argument("--k", type=int, default=4)
    a = ap.parse_args(argv)
    print(f"{a.num_seqs} requests, n {a.prompt_lookup_min}-{a.prompt_lookup_max}, k {a.k}, {a.steps} steps")
    print(f"{'context':>8}  {'index ms/step':>13}  {'scan ms/step':>12}  {'scan / index':>12}  {'indexing the prompts, ms':>24}")
    results = []
    for context in a.contexts:
        r = run(a.num_seqs, context, a.steps, a.prompt_lookup_min, a.prompt_lookup_max, a.k)
        results.append(r)
        print(f"{context:>8}  {r['index_ms']:>13.2f}  {r['scan_ms']:>12.2f}  {r['scan_ms'] / r['index_ms']:>12.2f}  "
              f"{r['build_ms']:>24.1f}", flush=True)
    return results


if __name__ == "__main__":
    main()
