"""The host-memory KV tier (issue 54): time to first token of a conversation's later turns
with and without `kv_offloading_size`, side by side in one run.

    python -m benchmarks.bench_kv_offload [--checkpoint PATH] [--history 4096] [--turns 4]
        [--other-users 2] [--repeats 3] [--json out.json]

One process, the offline engine (`backend.LLM`) driven step by step. A conversation
grows turn by turn to about `--history` tokens: each turn's prompt is the history so far
plus a new user message, its reply 16 greedy tokens. Between turns `--other-users`
unrelated prompts of half a history each run, as other users' traffic would. The device
pool holds about 1.25 histories, so those prompts evict the conversation's earlier blocks.
Two engines take the same turns in alternation: one without the tier (the turn recomputes
what the pool lost) and one with a host tier large enough for everything (the turn copies
it back). A turn's TTFT runs from its submission to the end of the step that returns its
first token. Printed per turn: the history length and each engine's median TTFT over the
repeats, their ratio, and whether the replies are token-equal.
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
REPLY = 16
BLOCK = 16


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, list[int]]:
    """(seconds to the first token, the whole reply) of one request on an idle engine."""
    engine = llm.engine
    params = SamplingParams(max_tokens=REPLY, min_tokens=REPLY, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    rid = engine.add_request(prompt, params).request_id
    first, tokens = None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != rid:
                continue
            if out.new_token_ids and first is None:     # (token_ids is filled in on the final output)
                first = time.perf_counter() - start
            if out.finished:
                tokens = out.token_ids
    return first, tokens


def conversation(vocab: int, history: int, turns: int, other_users: int, seed: int):
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(3, vocab) for _ in range(n)]   # noqa: E731
    message = history // turns - REPLY
    return ([words(message) for _ in range(turns)],
            [[words(history // 2) for _ in range(other_users)] for _ in range(turns)])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_kv_offload")
    ap.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT)
    ap.add_argument("--history", type=int, default=4096, help="tokens of the last turn's prompt, about")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--other-users", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    num_blocks = (a.history * 5 // 4) // BLOCK + 1
    kw = dict(block_size=BLOCK, num_kv_blocks=num_blocks, max_model_len=num_blocks * BLOCK,
              max_num_batched_tokens=a.history * 2, max_num_seqs=8, seed=a.seed)
    plain = LLM(a.checkpoint, **kw)
    s = plain.engine.stats()
    block_bytes = s["kv_cache_bytes"] // s["num_total_blocks"]
    # Room for every block the run computes: each turn's history and the other users'.
    host_blocks = a.repeats * a.turns * (a.history + a.other_users * a.history) // BLOCK + num_blocks
    tiered = LLM(a.checkpoint, kv_offloading_size=host_blocks * block_bytes / 2**30, **kw)
    vocab = plain.engine.model_config.vocab_size
    results = {name: [[] for _ in range(a.turns)] for name in ("without", "with")}
    lengths, equal = [0] * a.turns, True
    for repeat in range(a.repeats):
        # A new conversation each repeat (none of its blocks cached yet), the same for both.
        user, others = conversation(vocab, a.history, a.turns, a.other_users, a.seed + repeat)
        for name, llm in (("without", plain), ("with", tiered)):
            history, replies = [], []
            for turn in range(a.turns):
                history = history + user[turn]
                lengths[turn] = len(history)
                seconds, reply = ttft(llm, history)
                results[name][turn].append(seconds)
                replies.append(reply)
                history = history + reply
                for prompt in others[turn]:
                    ttft(llm, prompt)
            if name == "without":
                want = replies
            else:
                equal &= replies == want
    stats = tiered.engine.stats()
    report = {"checkpoint": a.checkpoint, "device_blocks": num_blocks, "block_size": BLOCK,
              "host_blocks": stats["kv_offload_host_blocks"], "replies_equal": equal,
              "hit_blocks": stats["kv_offload_hit_blocks"], "saved_blocks": stats["kv_offload_saved_blocks"],
              "turns": []}
    print(f"# {a.checkpoint}: device pool {num_blocks} blocks of {BLOCK} tokens, host tier "
          f"{stats['kv_offload_host_blocks']} blocks; {a.other_users} other users' prompts of "
          f"{a.history // 2} tokens between turns; {a.repeats} repeats; replies equal: {equal}")
    print("turn  history  TTFT without (ms)  TTFT with (ms)  ratio")
    for turn in range(a.turns):
        without = statistics.median(results["without"][turn])
        with_tier = statistics.median(results["with"][turn])
        report["turns"].append({"turn": turn + 1, "history_tokens": lengths[turn], "ttft_without_s": without,
                                "ttft_with_s": with_tier, "ratio": without / with_tier})
        print(f"{turn + 1:>4}  {lengths[turn]:>7}  {without * 1e3:>17.1f}  {with_tier * 1e3:>14.1f}  "
              f"{without / with_tier:>5.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
