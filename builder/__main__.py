"""python -m builder {tiny,build,default} ..."""

from __future__ import annotations

import argparse
import os
import sys

from builder.build import BuildError, BuildOptions, build
from builder.tiny import build_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CHECKPOINT = os.path.join(ROOT, "models", "tiny-llama")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m builder")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tiny", help="create the embedded default checkpoint (offline, deterministic)")
    t.add_argument("--output", required=True)

    b = sub.add_parser("build", help="checkpoint -> model-repository entry")
    b.add_argument("--checkpoint", required=True)
    b.add_argument("--output", required=True)
    b.add_argument("--name")
    b.add_argument("--weights", default="auto")
    b.add_argument("--kv-cache", default="auto")
    b.add_argument("--engine", default="torch")
    b.add_argument("--link", action="store_true", help="point at the checkpoint instead of copying it")
    for flag, typ in (("--block-size", int), ("--num-kv-blocks", int), ("--kv-cache-memory-bytes", int),
                      ("--max-num-seqs", int), ("--max-num-batched-tokens", int), ("--max-model-len", int),
                      ("--max-queue-size", int), ("--grace-period-s", float)):
        b.add_argument(flag, type=typ)
    b.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None)
    b.add_argument("--calibration-data", help="text file, one calibration prompt per line (fp8)")
    b.add_argument("--gpu-memory-gb", type=float, help="memory plan: device memory (default 80)")
    b.add_argument("--plan-seq-len", type=int, help="memory plan: sequence length (default 4096)")

    d = sub.add_parser("default", help="make sure model_repository/llm holds the default model")
    d.add_argument("--repository", default="model_repository")
    d.add_argument("--force", action="store_true")

    args = ap.parse_args(argv)
    try:
        if args.cmd == "tiny":
            build_tiny(args.output)
            print(f"wrote {args.output}")
        elif args.cmd == "build":
            kw = {k: v for k, v in vars(args).items() if k != "cmd" and v is not None}
            build(BuildOptions.create(**kw))
        else:
            target = os.path.join(args.repository, "llm")
            if os.path.isfile(os.path.join(target, "config.pbtxt")) and not args.force:
                print(f"{target} exists")
                return 0
            if not os.path.isfile(os.path.join(DEFAULT_CHECKPOINT, "config.json")):
                build_tiny(DEFAULT_CHECKPOINT)
            build(BuildOptions.create(checkpoint=DEFAULT_CHECKPOINT, output=target, name="llm",
                                      num_kv_blocks=1024, max_num_seqs=64, max_num_batched_tokens=512,
                                      max_queue_size=256))
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
