"""Two figures for the OpenAI frontend, each side by side in one run:

    python -m benchmarks.bench_openai frontend [--url localhost:8001 --openai-url http://localhost:9000]
        [--concurrency 4 --tokens 64 --rounds 3]
    python -m benchmarks.bench_openai bitmask [--checkpoint DIR --batch 32 --steps 50]

`frontend`: time per output token of streamed greedy requests through the frontend
(official `openai` client, SSE) vs straight to tritonserver over gRPC streaming, the same
prompts and lengths, alternating rounds at the same concurrency; median TPOT of each and
the ratio. Without --url it starts tritonserver on the default model and the frontend.

`bitmask`: what structured output adds to one decode step at batch B: filling B JSON
schema bitmasks, uploading and applying them, and advancing B matchers, vs the step
itself (the default model, B sequences decoding), measured in the same process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [f"Request number {i} asks about the {w} statement" for i, w in
           enumerate(["pass", "yield", "return", "raise", "with", "for", "while", "try"])]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}}, "required": ["name", "age"]}


def tpot(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1)


def grpc_tpot(url: str, prompt: str, tokens: int) -> float:
    from clients.triton_client import StreamingRequest
    res = StreamingRequest(url).run(prompt, {"max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True,
                                             "temperature": 0})
    assert res.ok and len(res.times) == tokens, res.error
    return tpot(res.times)


def openai_tpot(base_url: str, prompt: str, tokens: int) -> float:
    import openai
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    times = []
    for chunk in client.completions.create(model="llm", prompt=prompt, max_tokens=tokens, temperature=0,
                                           stream=True, extra_body={"min_tokens": tokens, "ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
    assert len(times) >= tokens * 0.9, len(times)   # a token whose text is empty sends no chunk text
    return tpot(times)


def sse_tpot(base_url: str, prompt: str, tokens: int) -> float:
    """The same request read as raw server-sent events (no client library parsing each
    chunk into objects): what the frontend itself adds."""
    import http.client
    import json
    conn = http.client.HTTPConnection(base_url.removeprefix("http://"), timeout=120)
    body = {"model": "llm", "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    times = []
    for line in response:
        if line.startswith(b"data: {") and b'"text": ""' not in line:
            times.append(time.perf_counter())
    conn.close()
    assert len(times) >= tokens * 0.9, len(times)
    return tpot(times)


def frontend(args) -> None:
    started = []
    url, openai_url = args.url, args.openai_url
    # Our frontend lists models through Triton's restricted repository API: it needs the
    # server's admin key (TRITON_ADMIN_KEY, or the key of the server started here).
    env = dict(os.environ)
    if url is None:
        from builder.__main__ import main as builder_main
        from clients.tritonserver import TritonServer
        builder_main(["default", "--repository", os.path.join(ROOT, "model_repository")])
        srv = TritonServer(os.path.join(ROOT, "model_repository")).start()
        started.append(srv)
        url = srv.grpc_url
        env.update(srv.admin.env())
    if openai_url is None:
        from clients.tritonserver import free_port
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "frontend.openai_api", "--port", str(port), "--host",
                                 "127.0.0.1", "--triton-url", url], cwd=ROOT, env=env)
        started.append(proc)
        openai_url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                urllib.request.urlopen(openai_url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
    try:
        results: dict[str, list[float]] = {"grpc": [], "openai": [], "sse": []}
        with ThreadPoolExecutor(args.concurrency) as pool:
            for _ in range(args.rounds):
                for name, fn, target in (("grpc", grpc_tpot, url), ("openai", openai_tpot, openai_url),
                                         ("sse", sse_tpot, openai_url)):
                    prompts = PROMPTS[:args.concurrency]
                    results[name] += pool.map(lambda p: fn(target, p, args.tokens), prompts)
        g, o, e = (statistics.median(results[k]) for k in ("grpc", "openai", "sse"))
        print(f"concurrency {args.concurrency}, {args.tokens} tokens, {args.rounds} alternating rounds; median TPOT: "
              f"direct gRPC (tritonclient) {1e3 * g:.2f} ms; through the frontend: official openai client "
              f"{1e3 * o:.2f} ms ({o / g:.3f}x), raw SSE reader {1e3 * e:.2f} ms ({e / g:.3f}x)")
    finally:
        for s in started:
            if hasattr(s, "stop"):
                s.stop()
            else:
                s.terminate()
                s.wait(timeout=10)


def bitmask(args) -> None:
    import numpy as np
    import torch
    from backend import LLM, SamplingParams
    from backend.engine.structured_output.bitmask import apply_bitmask
    from builder.tiny import build_tiny
    checkpoint = args.checkpoint or build_tiny(os.path.join(tempfile.gettempdir(), "paged_llm_default_model"))
    llm = LLM(checkpoint, num_kv_blocks=4096, max_num_seqs=args.batch, enable_prefix_caching=False)
    engine = llm.engine
    rng = np.random.default_rng(0)
    for _ in range(args.batch):
        engine.add_request(rng.integers(3, 4000, 32).tolist(),
                           SamplingParams(max_tokens=args.steps + 2, min_tokens=args.steps + 2, ignore_eos=True))
    engine.step()
    step_times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t0)
    while engine.has_unfinished_requests():
        engine.step()
    # The structured part alone, on B requests with matchers of the schema at the start.
    structured_params = SamplingParams(guided_json=SCHEMA, max_tokens=200)
    reqs = [engine.add_request("x", structured_params) for _ in range(args.batch)]
    while engine.scheduler.structured.num_compiling:
        engine.scheduler.update_grammars(wait_s=0.01)
    so = engine.scheduler.structured
    logits = torch.randn(args.batch, engine.model_config.vocab_size)
    fill, apply, advance = [], [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        mask = so.bitmask(len(reqs), list(enumerate(reqs)))
        t1 = time.perf_counter()
        apply_bitmask(logits, mask, engine.model_config.vocab_size)
        t2 = time.perf_counter()
        for r, token in zip(reqs, logits.argmax(-1).tolist()):
            if not r.grammar.accept_token(token) or r.grammar.is_terminated():
                r.grammar.reset()
        t3 = time.perf_counter()
        fill.append(t1 - t0)
        apply.append(t2 - t1)
        advance.append(t3 - t2)
        logits.normal_()
    for r in reqs:
        engine.abort_request(r.request_id)
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    total = ms(fill) + ms(apply) + ms(advance)
    print(f"batch {args.batch}: decode step {ms(step_times):.2f} ms; JSON-schema structured output per step: "
          f"fill {ms(fill):.3f} ms + apply {ms(apply):.3f} ms + advance {ms(advance):.3f} ms = {total:.3f} ms "
          f"({total / ms(step_times):.1%} of the step)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("frontend")
    f.add_argument("--url", help="tritonserver gRPC (default: start one on the default model)")
    f.add_argument("--openai-url", help="the frontend (default: start one)")
    f.add_argument("--concurrency", type=int, default=4)
    f.add_argument("--tokens", type=int, default=64)
    f.add_argument("--rounds", type=int, default=3)
    b = sub.add_parser("bitmask")
    b.add_argument("--checkpoint")
    b.add_argument("--batch", type=int, default=32)
    b.add_argument("--steps", type=int, default=50)
    args = ap.parse_args(argv)
    frontend(args) if args.cmd == "frontend" else bitmask(args)


if __name__ == "__main__":
    main()
