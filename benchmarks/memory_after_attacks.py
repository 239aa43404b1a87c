"""Memory of the frontend and of the `llm` backend process before, during and after the
large-input attacks of issue 49 (items 4, 7, 11, 12), against a running `make serve`.

    python -m benchmarks.memory_after_attacks --openai http://127.0.0.1:9000 --http http://127.0.0.1:8000 \
        --grpc 127.0.0.1:8001 --api-key KEY --repeat 10

After one normal-sized request of each kind (the baseline is the server after normal
use), each attack is sent `--repeat` times (with the mean seconds a request took); then
the resident memory (VmRSS) of the frontend process, of the HTTP guard (0 where none
runs: `make serve` starts it off loopback, `HOST=0.0.0.0 API_KEY=...`) and of the `llm`
stub is read right after, and again after `--settle-s`. Talks only to the given
addresses; reads /proc for the processes.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import urllib.request
from typing import Callable, Optional

MB = 1 << 20


def rss_mb(match: str) -> float:
    """Summed VmRSS of the processes whose command line contains `match`."""
    total = 0.0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if match.encode() not in f.read():
                    continue
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
        except (OSError, StopIteration):
            continue
    return round(total, 1)


def post(url: str, body: bytes, headers: dict) -> int:
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code
    except OSError:
        return 0


def grpc_text_input(url: str, text: str) -> int:
    """Item 4: `text_input` beside `input_ids=[1]` on Triton's gRPC port (a decoupled model:
    one stream). 400 when the model refused it with an error, 200 when it answered."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(url)
    errors: "queue.Queue" = queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: errors.put(error))
        inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("input_ids", [1], "INT32")]
        inputs[0].set_data_from_numpy(np.array([text.encode()], dtype=object))
        inputs[1].set_data_from_numpy(np.array([1], dtype=np.int32))
        client.async_stream_infer("llm", inputs, enable_empty_final_response=True)
        return 400 if errors.get(timeout=120) is not None else 200
    except Exception:                       # (the server gone, a timeout)
        return 0
    finally:
        client.stop_stream()
        client.close()


def attacks(openai: str, http: str, key: str, scale: int = MB,
            grpc: Optional[str] = None) -> dict[str, Callable[[], int]]:
    """Each attack; `scale` 1 gives the same requests at a normal size (the warm-up)."""
    auth = {"authorization": f"Bearer {key}"} if key else {}
    big = "word " * (3 * scale)                                # 15 MB of text
    return {
        # (the top-level `reasoning` field is what a stored response keeps: the red team's
        # 40 x 10 MB; a `reasoning` input item is dropped before anything is stored)
        "responses_10mb_reasoning": lambda: post(openai + "/v1/responses", json.dumps({
            "model": "llm", "max_output_tokens": 2, "reasoning": {"effort": "r" * (10 * scale)},
            "input": "hi"}).encode(), auth),
        "tokenize_15mb": lambda: post(openai + "/tokenize", json.dumps({"model": "llm", "prompt": big}).encode(),
                                      auth),
        "echo_logprobs_15mb": lambda: post(openai + "/v1/completions", json.dumps({
            "model": "llm", "prompt": big, "echo": True, "logprobs": 1, "max_tokens": 0}).encode(), auth),
        "generate_15mb": lambda: post(http + "/v2/models/llm/generate", json.dumps({
            "text_input": big, "max_tokens": 2}).encode(), {}),
        **({"grpc_text_input_15mb": lambda: grpc_text_input(grpc, big)} if grpc else {}),
    }


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--openai", default="http://127.0.0.1:9000")
    ap.add_argument("--http", default="http://127.0.0.1:8000")
    ap.add_argument("--grpc", default="127.0.0.1:8001", help="Triton's gRPC address ('' leaves that attack out)")
    ap.add_argument("--api-key", default=os.environ.get("API_KEY", ""))
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--settle-s", type=float, default=10.0)
    ap.add_argument("--no-warm-up", action="store_true",
                    help="take the baseline right away, not after one normal-sized request of each kind")
    args = ap.parse_args(argv)
    def memory() -> dict:
        return {"frontend_mb": rss_mb("frontend.openai_api"), "guard_mb": rss_mb("frontend.http_guard"),
                "llm_stub_mb": rss_mb("/llm/1/model.py")}
    print(json.dumps({"at_start": memory()}), flush=True)
    if not args.no_warm_up:
        # The baseline is the server after normal use: what each route loads or builds on
        # its first request (code, schemas, caches) is not the attack's.
        warm = [attack() for attack in attacks(args.openai, args.http, args.api_key, scale=1,
                                grpc=args.grpc).values()]
        time.sleep(args.settle_s)
        print(json.dumps({"warm_up_statuses": warm}), flush=True)
    print(json.dumps({"baseline": memory()}), flush=True)
    for name, attack in attacks(args.openai, args.http, args.api_key, grpc=args.grpc).items():
        t0 = time.perf_counter()
        statuses = [attack() for _ in range(args.repeat)]
        seconds_each = round((time.perf_counter() - t0) / args.repeat, 3)
        right_after = memory()
        time.sleep(args.settle_s)
        print(json.dumps({"attack": name, "statuses": sorted(set(statuses)), "seconds_each": seconds_each,
                          "right_after": right_after, f"after_{args.settle_s:g}s": memory()}), flush=True)


if __name__ == "__main__":
    main()
