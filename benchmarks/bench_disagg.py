"""Prefill/decode disaggregation (issue 55) against one aggregated engine of the same
total size, side by side in one run, both under NVIDIA Dynamo's frontend.

    python -m benchmarks.bench_disagg [--streams 4] [--stream-tokens 160] [--long-prompts 6]
        [--long-prompt-words 700] [--gap-s 1.0] [--max-num-batched-tokens 2048] [--json out.json]

The same workload runs twice: against one aggregated worker (2N KV blocks, the
machine's two cores), then against a prefill worker and a decode worker over NIXL (N
blocks and one core each). `--streams` clients stream long greedy replies from short
prompts (their inter-token latency is what a long prefill stalls), while
`--long-prompts` prompts of about `--long-prompt-words` words arrive `--gap-s` apart,
each asking 8 tokens. Printed per topology: the streams' ITL p50/p99, the long
prompts' TTFT p50/p99, and output tokens per second over the whole run.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.report import dump, print_table
from clients.dynamo_local import models_listed, start_frontend, start_services, start_worker

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
         "tau upsilon phi chi psi omega").split()


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def workload(port: int, args, seed: int) -> dict:
    import openai
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    rng = random.Random(seed)
    itls: list[float] = []
    ttfts: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def stream(i: int) -> None:
        prompt = f"Stream {seed}-{i}: the with statement"
        last = None
        for chunk in client.completions.create(model="llm", prompt=prompt, max_tokens=args.stream_tokens,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True}):
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                with lock:
                    if last is not None:
                        itls.append(now - last)
                    tokens[0] += 1
                last = now

    def long_prompt(i: int) -> None:
        time.sleep(i * args.gap_s)
        prompt = " ".join(rng.choice(WORDS) for _ in range(args.long_prompt_words))
        start = time.perf_counter()
        first = None
        for chunk in client.completions.create(model="llm", prompt=prompt, max_tokens=8, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].text:
                first = first or time.perf_counter() - start
                with lock:
                    tokens[0] += 1
        if first is not None:
            ttfts.append(first)

    start = time.perf_counter()
    with ThreadPoolExecutor(args.streams + args.long_prompts) as pool:
        futures = [pool.submit(stream, i) for i in range(args.streams)]
        time.sleep(1.0)                     # the streams are decoding when the first long prompt comes
        futures += [pool.submit(long_prompt, i) for i in range(args.long_prompts)]
        for f in futures:
            f.result()
    wall = time.perf_counter() - start
    return {"itl_p50_ms": 1000 * statistics.median(itls), "itl_p99_ms": 1000 * percentile(itls, 0.99),
            "ttft_p50_ms": 1000 * statistics.median(ttfts), "ttft_p99_ms": 1000 * percentile(ttfts, 0.99),
            "output_tok_s": tokens[0] / wall, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=160)
    ap.add_argument("--long-prompts", type=int, default=6)
    ap.add_argument("--long-prompt-words", type=int, default=700)
    ap.add_argument("--gap-s", type=float, default=1.0)
    ap.add_argument("--blocks", type=int, default=256, help="N: each disaggregated worker's pool (aggregated: 2N)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="every worker's step budget: a long prompt in fewer, longer steps as it grows")
    ap.add_argument("--json")
    args = ap.parse_args()
    from builder.build import BuildOptions, build
    from builder.train_tiny import build_trained
    root = tempfile.mkdtemp(prefix="bench-disagg-")
    checkpoint = build_trained(os.path.join(root, "checkpoint"))
    repo = os.path.join(root, "repo")
    for name, blocks in (("aggregated", 2 * args.blocks), ("half", args.blocks)):
        build(BuildOptions.create(checkpoint=checkpoint, output=os.path.join(repo, name), name=name, link=True,
                                  block_size=16, num_kv_blocks=blocks, max_num_seqs=16,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=2048), log=lambda *_: None)
    results = {}
    topologies = {"aggregated": [("aggregated", "aggregated", "2")],
                  "disaggregated": [("half", "prefill", "1"), ("half", "decode", "1")]}
    for name, workers in topologies.items():
        os.makedirs(os.path.join(root, name))
        stack = start_services(os.path.join(root, name))
        try:
            for entry, mode, threads in workers:
                stack.env["OMP_NUM_THREADS"] = threads
                start_worker(stack, mode, repo, entry, mode, served_model_name="llm")
            frontend = start_frontend(stack, "frontend", "kv")
            stack.wait_for(lambda: models_listed(frontend.port, "llm"), "the frontend")
            stack.wait_for(lambda: all("serving llm" in c.log() for c in stack.children if c.name in
                                       ("aggregated", "prefill", "decode")), "the workers")
            workload(frontend.port, argparse.Namespace(**{**vars(args), "long_prompts": 1, "streams": 1,
                                                          "stream_tokens": 8}), seed=0)       # warm-up
            results[name] = workload(frontend.port, args, seed=1)
            print(name, results[name], flush=True)
        finally:
            stack.stop_all()
    print_table(["topology", "ITL p50 ms", "ITL p99 ms", "TTFT p50 ms", "TTFT p99 ms", "out tok/s"],
                [[name, r["itl_p50_ms"], r["itl_p99_ms"], r["ttft_p50_ms"], r["ttft_p99_ms"], r["output_tok_s"]]
                 for name, r in results.items()])
    dump(args.json, args, results=results)


if __name__ == "__main__":
    main()
