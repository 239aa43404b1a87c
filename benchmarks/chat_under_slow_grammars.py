"""Plain chat latency while slow grammars compile (issue 49 item 9), against a running
OpenAI frontend (`make serve`): one plain chat completion at a time, alone, then while
six tiny JSON schemas whose patterns compile for minutes (`(e|f){1,16000+i}`) are in
flight, then after they ended (each is given up on at `guided_compile_timeout_s`).

    python -m benchmarks.chat_under_slow_grammars [--url http://127.0.0.1:9000] [--api-key KEY]

Prints each phase's p50 and max latency and status codes, and the slow requests' codes
and seconds. Talks only to the given address.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from typing import Optional

from benchmarks.memory_after_attacks import post


def chat(url: str, body: dict, key: str) -> tuple[int, float]:
    """(status, seconds) of one chat completion (status 0: no answer)."""
    t0 = time.perf_counter()
    status = post(url + "/v1/chat/completions", json.dumps(body).encode(),
                  {"authorization": f"Bearer {key}"} if key else {})
    return status, time.perf_counter() - t0


def slow_schema(model: str, i: int) -> dict:
    pattern = "(e|f){1,%d}" % (16000 + i)
    return {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
                "type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}}}}}


def summary(results: list[tuple[int, float]]) -> str:
    times = sorted(t for _, t in results)
    return (f"n={len(times)} p50={statistics.median(times) * 1000:.0f} ms max={times[-1] * 1000:.0f} ms "
            f"codes={sorted({c for c, _ in results})}")


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:9000")
    ap.add_argument("--api-key", default=os.environ.get("API_KEY", ""))
    ap.add_argument("--model", default="llm")
    ap.add_argument("--slow", type=int, default=6, help="slow schemas in flight")
    ap.add_argument("--seconds", type=float, nargs=3, default=[6, 8, 4], metavar=("ALONE", "DURING", "AFTER"))
    args = ap.parse_args(argv)
    plain = {"model": args.model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16,
             "temperature": 0}

    def measure(seconds: float) -> list[tuple[int, float]]:
        out, end = [chat(args.url, plain, args.api_key)], time.time() + seconds
        while time.time() < end:
            time.sleep(0.1)
            out.append(chat(args.url, plain, args.api_key))
        return out

    for _ in range(3):
        chat(args.url, plain, args.api_key)             # (warm)
    alone = measure(args.seconds[0])
    slow: list[tuple[int, float]] = []
    threads = [threading.Thread(target=lambda i=i: slow.append(chat(args.url, slow_schema(args.model, i),
                                                                    args.api_key))) for i in range(args.slow)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    during = measure(args.seconds[1])
    for t in threads:
        t.join()
    after = measure(args.seconds[2])
    print("plain alone ", summary(alone))
    print("plain during", summary(during))
    print("plain after ", summary(after))
    print("slow schemas", sorted({c for c, _ in slow}), [round(t, 1) for _, t in slow])


if __name__ == "__main__":
    main()
