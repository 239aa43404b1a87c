"""Stream a completion to the terminal over tritonclient gRPC streaming.

    python -m clients.generate "Tell me a story" --max-tokens 64
"""

from __future__ import annotations

import argparse
import sys

from clients.triton_client import StreamingRequest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clients.generate")
    ap.add_argument("prompt")
    ap.add_argument("--url", default="localhost:8001", help="gRPC endpoint (host:port)")
    ap.add_argument("--model", default="llm")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-tokens", type=int)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--min-p", type=float)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--repetition-penalty", type=float)
    ap.add_argument("--stop", action="append", help="stop string (repeatable)")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--no-stream", action="store_true", help="one response at the end")
    args = ap.parse_args(argv)
    sampling = {k: v for k, v in dict(
        max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
        repetition_penalty=args.repetition_penalty, stop=args.stop,
        ignore_eos=args.ignore_eos or None).items() if v is not None}
    res = StreamingRequest(args.url, args.model).run(
        args.prompt, sampling, stream=not args.no_stream,
        on_piece=lambda p: (sys.stdout.write(p), sys.stdout.flush()))
    sys.stdout.write("\n")
    if res.error:
        print(f"error: {res.error}", file=sys.stderr)
        return 1
    print(f"[finish_reason={res.finish_reason} tokens={len(res.token_ids)}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
