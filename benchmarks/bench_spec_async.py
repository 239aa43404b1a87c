"""Draft-model speculation with async scheduling on against off, side by side in one run
(output tokens/s, interleaved repeats, medians), at batch 1 and a larger batch.

    python -m benchmarks.bench_spec_async [--tokens 96 --repeats 3 --hidden 512 --layers 8 --batch 8]

The target is bench_spec's random-weight Mistral. Two drafts: the target itself (every
proposal accepted: the best case) and a random one-layer model of the same vocabulary
(none accepted: the machinery's cost). Under async scheduling a speculating request sits
out the step launched while its own is in flight, so it verifies every other step; on a
CPU the forward runs on the host, so nothing overlaps and this shows what that costs.
The two modes' outputs must be equal (greedy), or the run fails.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from benchmarks.bench_spec import make_checkpoint


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=96, help="generated tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="the larger batch (batch 1 runs too)")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    args = ap.parse_args(argv)
    import torch

    from backend import LLM, SamplingParams
    tmp = tempfile.gettempdir()
    vocab, window = 4096, 16
    path = make_checkpoint(os.path.join(tmp, f"paged_llm_bench_spec_{args.hidden}x{args.layers}w{window}v{vocab}"),
                           args.hidden, args.layers, 8, vocab, window)
    small = make_checkpoint(os.path.join(tmp, f"paged_llm_bench_spec_draft_v{vocab}"), 64, 1, 2, vocab, window,
                            seed=1)
    engine = dict(dtype="float32", block_size=16, num_kv_blocks=2048, max_num_seqs=max(16, args.batch),
                  max_num_batched_tokens=1024)
    llms = {(draft, on): LLM(path, speculative_config={"method": "draft_model", "model": model,
                                                       "num_speculative_tokens": args.k},
                             async_scheduling=on, **engine)
            for draft, model in (("target", path), ("random", small)) for on in (False, True)}
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    rates: dict[tuple, list[float]] = {}
    outputs: dict[tuple, list] = {}
    for batch in sorted({1, args.batch}):
        prompts = [rng.integers(3, vocab, 64).tolist() for _ in range(batch)]
        for _ in range(args.repeats):
            for (draft, on), llm in llms.items():
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params)
                rates.setdefault((batch, draft, on), []).append(batch * args.tokens / (time.perf_counter() - t0))
                outputs[(batch, draft, on)] = [o.token_ids for o in outs]
    print(f"target: Mistral, hidden {args.hidden}, {args.layers} layers, fp32, k={args.k}, {args.tokens} tokens per "
          f"request, {torch.get_num_threads()} threads; median of {args.repeats} interleaved runs")
    print(f"{'batch':>5} {'draft':>7} {'async off tok/s':>16} {'async on tok/s':>15} {'on / off':>9}")
    results = []
    for batch, draft, _ in sorted({k[:2] + (None,) for k in rates}, key=lambda k: (k[0], k[1])):
        if outputs[(batch, draft, False)] != outputs[(batch, draft, True)]:
            raise SystemExit(f"batch {batch}, draft {draft}: async on and off gave different tokens")
        off, on = (statistics.median(rates[(batch, draft, m)]) for m in (False, True))
        print(f"{batch:>5} {draft:>7} {off:>16.1f} {on:>15.1f} {on / off:>8.2f}x")
        results.append({"batch": batch, "draft": draft, "off_tokens_per_s": off, "on_tokens_per_s": on,
                        "off_runs": rates[(batch, draft, False)], "on_runs": rates[(batch, draft, True)]})
    return results


if __name__ == "__main__":
    main()
