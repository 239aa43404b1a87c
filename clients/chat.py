"""An interactive chat in the terminal with a running server's OpenAI API:

    paged-llm chat [--url http://127.0.0.1:9000/v1] [--model NAME] [--system TEXT]

Each line you type is a user turn; the reply streams back; the conversation is kept
(/reset forgets it, /exit or Ctrl-D ends). Reads from a pipe too: one turn a line.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="paged-llm chat", description=__doc__.splitlines()[0],
                                 epilog="example:\n  paged-llm chat --model Llama-3.2-1B --system 'Be brief.'",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=f"http://127.0.0.1:{os.environ.get('OPENAI_PORT', 9000)}/v1")
    ap.add_argument("--model", help="default: the server's first model")
    ap.add_argument("--api-key", default=os.environ.get("API_KEY", "none"))
    ap.add_argument("--system", help="a system message first")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.7)
    args = ap.parse_args(argv)
    import openai
    client = openai.OpenAI(base_url=args.url, api_key=args.api_key, max_retries=0)
    try:
        models = [m.id for m in client.models.list().data]
    except openai.OpenAIError as e:
        print(f"paged-llm chat: no server at {args.url}: {e}", file=sys.stderr)
        return 2
    if not args.model and not models:
        print(f"paged-llm chat: the server at {args.url} serves no model", file=sys.stderr)
        return 2
    model = args.model or models[0]
    try:
        return _converse(client, model, args)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        return 0


def _converse(client, model: str, args) -> int:
    import openai
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            messages = list(start)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        try:
            for chunk in client.chat.completions.create(model=model, messages=messages, stream=True,
                                                        max_tokens=args.max_tokens, temperature=args.temperature):
                piece = chunk.choices[0].delta.content if chunk.choices else None
                if piece:
                    reply.append(piece)
                    sys.stdout.write(piece)
                    sys.stdout.flush()
        except openai.OpenAIError as e:
            print(f"\n[error: {e}]", file=sys.stderr)
            messages.pop()
            continue
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
