"""A gRPC cancellation storm against a supervised server, and how long it takes to serve
again if it brings tritonserver down (issue 49 item 5: Triton 24.10 crashed in 2 of 7
such runs, upstream issues #7368, #7840, #8034).

    python -m benchmarks.cancel_storm --grpc 127.0.0.1:8001 --supervisor http://127.0.0.1:8003 \
        --rounds 7 --streams 800 --concurrency 200

Each round: `--streams` streaming requests to model `llm`, `--concurrency` at a time, each
cancelled (the gRPC call itself, as a client that goes away) after a random 0-20 of its
responses. After the round: whether the supervisor counted a failure, and if so the
seconds until `/ready` said 200 again. Talks only to the given addresses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import urllib.error
import urllib.request
from typing import Optional

from frontend.openai_api.triton_client import ClientDisconnected, Generation
from frontend.openai_api.errors import APIError

SAMPLING = {"max_tokens": 200, "min_tokens": 200, "ignore_eos": True, "temperature": 0}


def supervisor(url: str, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + path, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except OSError:
        return 0, {}


async def one_stream(client, i: int, cancel_after: int) -> str:
    gen = Generation(client, "llm", f"Story number {i}:", dict(SAMPLING), True, False)
    seen = 0
    try:
        async for _ in gen:
            seen += 1
            if seen >= cancel_after:
                gen.cancel()
                break
        return "cancelled" if seen >= cancel_after else "finished"
    except ClientDisconnected:
        return "cancelled"
    except APIError as e:
        return f"error {e.status}"


async def storm(grpc_url: str, streams: int, concurrency: int, seed: int) -> dict[str, int]:
    import tritonclient.grpc.aio as grpcclient
    rng = random.Random(seed)
    client = grpcclient.InferenceServerClient(grpc_url)
    gate = asyncio.Semaphore(concurrency)
    outcomes: dict[str, int] = {}

    async def run(i: int) -> None:
        async with gate:
            try:
                outcome = await one_stream(client, i, rng.randint(0, 20))
            except Exception as e:  # noqa: BLE001 (a server going down mid-storm: counted)
                outcome = type(e).__name__
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

    await asyncio.gather(*(run(i) for i in range(streams)))
    await client.close()
    return outcomes


def wait_ready(url: str, timeout_s: float) -> Optional[float]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if supervisor(url, "/ready")[0] == 200:
            return time.monotonic() - t0
        time.sleep(0.1)
    return None


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grpc", default="127.0.0.1:8001")
    ap.add_argument("--supervisor", default="http://127.0.0.1:8003")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--streams", type=int, default=800)
    ap.add_argument("--concurrency", type=int, default=200)
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    rounds = []
    for r in range(args.rounds):
        before = supervisor(args.supervisor, "/status")[1]
        t0 = time.monotonic()
        outcomes = asyncio.run(storm(args.grpc, args.streams, args.concurrency, seed=r))
        took = time.monotonic() - t0
        after = supervisor(args.supervisor, "/status")[1]
        failed = sum(after.get("failures", {}).values()) - sum(before.get("failures", {}).values())
        back = wait_ready(args.supervisor, 180) if failed or supervisor(args.supervisor, "/ready")[0] != 200 else 0.0
        after = supervisor(args.supervisor, "/status")[1]
        row = {"round": r + 1, "seconds": round(took, 1), "outcomes": outcomes,
               "failures": after.get("failures", {}), "new_failures": failed,
               "ready_again_after_s": None if back is None else round(back, 1),
               "last_recovery_s": after.get("last_recovery_s")}
        print(json.dumps(row), flush=True)
        rounds.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rounds, f, indent=1)


if __name__ == "__main__":
    main()
