"""KV-aware routing across replicas (issue 55): Dynamo's KV router against its
round-robin mode over the same two of our workers, side by side in one run.

    python -m benchmarks.bench_dynamo_routing [--conversations 8] [--turns 5] [--concurrency 4]
        [--repeats 2] [--json out.json]

Starts NATS, etcd, two Dynamo workers (`python -m backend.dynamo_worker`, one torch thread
each) over one entry of the trained reference model, and Dynamo's frontend twice over
them: `--router-mode kv` and `round-robin`. Each mode serves its own conversations (so
neither finds the other's prefixes): every turn sends the whole history plus a new user
message of about 40 tokens, and gets a 16-token greedy reply, streamed. Conversations run
`--concurrency` at a time. Printed per mode: the prefix hit rate of turns after the first
(the usage's cached_tokens over prompt_tokens, as each worker's prefix cache served
them), and TTFT p50/p99 of those turns. Modes alternate over `--repeats`.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from benchmarks.report import dump, print_table
from clients.dynamo_local import deploy, start_services

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
         "tau upsilon phi chi psi omega").split()


def conversation(client, rng: random.Random, turns: int) -> list[tuple[Optional[float], int, int]]:
    """(TTFT, prompt tokens, cached tokens) of each turn after the first (no TTFT for a
    reply that ended before any text)."""
    history = " ".join(rng.choice(WORDS) for _ in range(120))
    rows = []
    for turn in range(turns):
        history += "\nuser: " + " ".join(rng.choice(WORDS) for _ in range(40)) + "\nassistant:"
        start = time.perf_counter()
        first = None
        text = ""
        usage = None
        for chunk in client.completions.create(model="llm", prompt=history, max_tokens=16, temperature=0,
                                               stream=True, stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].text and first is None:
                first = time.perf_counter() - start
            text += chunk.choices[0].text if chunk.choices else ""
            usage = chunk.usage or usage
        history += text
        if turn and usage is not None:
            rows.append((first, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))
    return rows


def run_mode(port: int, seed: int, conversations: int, turns: int, concurrency: int) -> dict:
    import openai
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda i: conversation(client, random.Random(seed * 1000 + i), turns),
                                range(conversations)))
    rows = [r for conv in results for r in conv]
    ttfts = sorted(r[0] for r in rows if r[0] is not None)
    return {"hit_rate": sum(r[2] for r in rows) / sum(r[1] for r in rows),
            "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], "turns": len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    from builder.build import BuildOptions, build
    from builder.train_tiny import build_trained
    root = tempfile.mkdtemp(prefix="bench-dynamo-")
    checkpoint = build_trained(os.path.join(root, "checkpoint"))
    repo = os.path.join(root, "repo")
    build(BuildOptions.create(checkpoint=checkpoint, output=os.path.join(repo, "llm"), name="llm", link=True,
                              block_size=16, num_kv_blocks=512, max_num_seqs=16, max_num_batched_tokens=512,
                              max_model_len=2048), log=lambda *_: None)
    os.environ["OMP_NUM_THREADS"] = "1"          # two workers on a two-core machine
    stack = start_services(root)
    try:
        _, frontends = deploy(stack, repo, 2, {"kv": None, "round-robin": None})
        results: dict[str, list[dict]] = {"kv": [], "round-robin": []}
        for repeat in range(args.repeats):
            for i, mode in enumerate(("kv", "round-robin") if repeat % 2 == 0 else ("round-robin", "kv")):
                seed = 1 + 2 * repeat + i
                results[mode].append(run_mode(frontends[mode].port, seed, args.conversations, args.turns,
                                              args.concurrency))
                print(mode, results[mode][-1], flush=True)
    finally:
        stack.stop_all()
    print_table(["router", "hit rate", "TTFT p50 ms", "TTFT p99 ms"],
                [[mode, statistics.mean(r["hit_rate"] for r in runs), statistics.median(r["ttft_p50_ms"] for r in runs),
                  statistics.median(r["ttft_p99_ms"] for r in runs)] for mode, runs in results.items()])
    dump(args.json, args, results=results)


if __name__ == "__main__":
    main()
