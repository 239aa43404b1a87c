"""How long the OpenAI frontend's event loop waits while it refuses a huge prompt (issue 49
items 2 and 11: no request may stall it past 100 ms). The frontend's app runs in this
process under uvicorn, with the served model faked (no Triton: the prompt is refused for
its length before generation), and a 1 ms ticker on its event loop records the longest
gap while a `--mib` MiB prompt is posted to `/tokenize` and to `/v1/completions` with
`echo` and `logprobs`.

    python -m benchmarks.event_loop_stall [--checkpoint model_repository/llm/checkpoint] [--mib 15] [--trials 3]

The checkpoint gives the tokenizer (the default: `make model`'s or `make model-random`'s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Awaitable, Optional, TypeVar

from benchmarks.memory_after_attacks import post

T = TypeVar("T")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CHECKPOINT = os.path.join(ROOT, "model_repository", "llm", "checkpoint")


async def longest_wait(work: Awaitable[T]) -> tuple[T, float]:
    """`work`'s result, and the longest the running event loop waited meanwhile between
    turns of a 1 ms ticker (seconds)."""
    gaps, done = [], asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)           # (the ticker under way)
    try:
        return await work, max(gaps)
    finally:
        done.set()
        await ticker


async def measure(checkpoint: str, mib: int, trials: int, max_model_len: int) -> list[tuple[str, int, float, float]]:
    """(route, status, seconds, the loop's longest gap in seconds) per trial."""
    import uvicorn

    from frontend.openai_api.app import create_app
    from frontend.openai_api.triton_client import ServedModel

    class Served:                       # the frontend's view of Triton: one model, no server
        client = health = None

        async def models(self):
            return {"llm": self.model_}

        async def model(self, name):
            return self.model_

        async def close(self):
            pass

    served = Served()
    served.model_ = ServedModel("llm", checkpoint, 1, "llm", max_model_len=max_model_len)
    app = create_app("127.0.0.1:1")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    app.state.llm = served
    port = server.servers[0].sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    prompt = "word " * (mib * (1 << 20) // 5)
    bodies = {"/tokenize": {"model": "llm", "prompt": prompt},
              "/v1/completions": {"model": "llm", "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0}}
    await loop.run_in_executor(None, post, f"http://127.0.0.1:{port}/tokenize",
                               json.dumps({"model": "llm", "prompt": "hi"}).encode(), {})     # (warm)
    results = []
    for route, body in bodies.items():
        raw = json.dumps(body).encode()
        for _ in range(trials):
            t0 = time.perf_counter()
            status, gap = await longest_wait(loop.run_in_executor(None, post, f"http://127.0.0.1:{port}{route}", raw, {}))
            results.append((route, status, time.perf_counter() - t0, gap))
    server.should_exit = True
    await serving
    return results


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT)
    ap.add_argument("--mib", type=int, default=15)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args(argv)
    for route, status, seconds, gap in asyncio.run(measure(args.checkpoint, args.mib, args.trials,
                                                           args.max_model_len)):
        print(f"{route:16s} {status}  {seconds * 1000:6.0f} ms  loop's longest wait {gap * 1000:5.1f} ms", flush=True)


if __name__ == "__main__":
    main()
