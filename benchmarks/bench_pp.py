"""Decode throughput at pipeline_parallel_size 2 with 1 vs 2 micro-batches in flight
(max_concurrent_batches, backend/engine/scheduling/batch_queue.py), and the pipeline bubble: the
share of the time each stage spends waiting on the other, side by side in one run.

    python -m benchmarks.bench_pp [--batch 16 --tokens 48 --hidden 1024 --layers 8 --repeats 3]

Builds a random-weight Llama checkpoint of the given size (fp32; the vocabulary kept
small so that the last stage's head does not outweigh a layer pair), admits `batch`
requests of a random prompt each, runs their prompts, then times the pure decode of
`tokens` tokens each: output tokens per second. The bubble comes from the ranks' own
timers (TensorParallelWorkers.stage_times): rank 0 (stage 0, also the scheduler and
sampler) waits for the last stage's logits; rank 1 (stage 1) waits for the next step
plan and for stage 0's hidden state. The configurations alternate, `repeats` times;
medians are shown, and the greedy tokens of both must agree. On CPU the two ranks share
the machine's cores (cores / 2 threads each: one each on a 2-core machine).

Overlap can only pay if the machine runs the two ranks at once at full speed, so the
run ends with what it does: a stage-sized matmul loop (one thread) timed alone and in two
processes at once (`parallel speed-up`: 2.0 on two free cores, 1.0 when the two
processes only take turns, e.g. cores shared with other work).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from benchmarks.bench_tp import add_model_args, checkpoint_from_args


def decode_run(llm, batch: int, tokens: int, prompt_len: int = 32, seed: int = 0) -> tuple[float, list, list]:
    """Decode tokens/s of `batch` requests, each stage's (wait s, elapsed s) over the
    decode, and the requests' tokens."""
    from backend import SamplingParams
    engine = llm.engine
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=tokens + 1, min_tokens=tokens + 1, temperature=0)
    requests = [engine.add_request(rng.integers(3, engine.model_config.vocab_size, prompt_len).tolist(), params)
                for _ in range(batch)]
    while any(not r.output_token_ids for r in requests):
        engine.step()                                   # prompts and the first token
    engine.workers.stage_times(engine.model, reset=True)
    start_tokens = sum(len(r.output_token_ids) for r in requests)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - t0
    times = engine.workers.stage_times(engine.model)
    generated = batch * (tokens + 1) - start_tokens
    return generated / elapsed, times, [r.output_token_ids for r in requests]


def _matmul_loop(hidden: int, rows: int, seconds: float, out) -> None:
    import torch
    torch.set_num_threads(1)
    weights = [torch.randn(hidden, hidden * 11 // 4) for _ in range(12)]
    x = torch.randn(rows, hidden)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        for w in weights:
            x @ w
        n += 1
    out.put(n / (time.perf_counter() - t0))


def parallel_speedup(hidden: int, rows: int, seconds: float = 4.0) -> float:
    """Passes per second of two one-thread processes at once over one alone."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    rates = []
    for n in (1, 2):
        out = ctx.Queue()
        procs = [ctx.Process(target=_matmul_loop, args=(hidden, rows, seconds, out)) for _ in range(n)]
        for p in procs:
            p.start()
        rates.append(sum(out.get(timeout=120) for _ in procs))
        for p in procs:
            p.join()
    return rates[1] / rates[0]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    add_model_args(ap, vocab=8192)
    args = ap.parse_args(argv)
    from backend import LLM
    path = checkpoint_from_args(args, f"paged_llm_bench_pp_{args.hidden}x{args.layers}v{args.vocab}")
    results: dict[int, list[tuple[float, list]]] = {}
    tokens: dict[int, list] = {}
    for _ in range(args.repeats):
        for batches in (1, 2):
            with LLM(path, dtype="float32", pipeline_parallel_size=2, max_concurrent_batches=batches,
                     block_size=16, num_kv_blocks=1024, max_num_seqs=args.batch, enable_prefix_caching=False) as llm:
                tps, times, toks = decode_run(llm, args.batch, args.tokens)
                results.setdefault(batches, []).append((tps, times))
                tokens.setdefault(batches, toks)
    assert tokens[1] == tokens[2], "1 and 2 micro-batches in flight gave different greedy tokens"
    print(f"checkpoint {path}: hidden {args.hidden}, {args.layers} layers (2 stages of {args.layers // 2}), "
          f"vocab {args.vocab}, fp32, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; batch "
          f"{args.batch}, {args.tokens} decode tokens each; median of {args.repeats} alternating runs")
    print(f"{'in flight':>9} {'decode tok/s':>13} {'vs 1':>6} {'stage 0 waits':>14} {'stage 1 waits':>14}")
    one = statistics.median(t for t, _ in results[1])
    for batches in (1, 2):
        runs = results[batches]
        tps = statistics.median(t for t, _ in runs)
        waits = [statistics.median(times[r][0] / times[r][1] for _, times in runs) for r in range(2)]
        print(f"{batches:>9} {tps:>13.1f} {tps / one:>6.2f} {waits[0]:>14.0%} {waits[1]:>14.0%}")
    print(f"parallel speed-up of this machine for two one-thread processes (matmuls of a stage's shape, "
          f"{args.batch // 2} rows): {parallel_speedup(args.hidden, args.batch // 2):.2f}; load average "
          f"{os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
