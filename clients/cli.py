"""`paged-llm`: one command, as `vllm serve` is one.

    paged-llm serve [PATH] [--port 9000] [--served-model-name NAME] [--api-key KEY]
                    [--max-model-len N] [--dtype D] [--kv-cache-dtype D] [--quantization fp8] ...
    paged-llm build ...      the builder (python -m builder build)
    paged-llm plan ...       the capacity and cost planner (python -m builder plan)
    paged-llm generate ...   stream a completion from a running server (python -m clients.generate)
    paged-llm chat ...       chat with a running server in the terminal (clients/chat.py)
    paged-llm bench ...      the benchmarks (python -m benchmarks.bench)

`serve` builds PATH (a Hugging Face checkpoint folder) into a model-repository entry,
once: the entry is cached under PAGED_LLM_CACHE (default ~/.cache/paged-llm), keyed by
the checkpoint's files and the options, and a later start with the same reuses it. It
then starts tritonserver, the supervisor and the OpenAI API, as `make serve` does (the
launcher's own options, --http-port and the rest, pass through). Without PATH it serves
the trained reference model, which writes text and stops on its own.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Callable, Optional

# vLLM's engine-argument names -> the builder's options (the rest of a build's options
# keep their defaults; `paged-llm build` takes them all).
BUILD_FLAGS = {"--max-model-len": ("max_model_len", int), "--max-num-seqs": ("max_num_seqs", int),
               "--max-num-batched-tokens": ("max_num_batched_tokens", int), "--block-size": ("block_size", int),
               "--num-kv-blocks": ("num_kv_blocks", int), "--tensor-parallel-size": ("tensor_parallel_size", int),
               "--pipeline-parallel-size": ("pipeline_parallel_size", int),
               "--kv-offloading-size": ("kv_offloading_size", float),
               "--scheduling-policy": ("scheduling_policy", str),
               "--priority-aging-s": ("priority_aging_s", float),
               "--lower-priority-prefill-tokens": ("lower_priority_prefill_tokens", int),
               # vLLM's flag: JSON, or the builder's shorthand ('eagle3:/ckpt/head:4')
               "--speculative-config": ("speculative", str)}
DELEGATES = {"build": ("builder", ["build"]), "plan": ("builder", ["plan"]), "generate": ("clients.generate", []),
             "chat": ("clients.chat", []), "bench": ("benchmarks.bench", [])}


def cache_root() -> str:
    return os.environ.get("PAGED_LLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "paged-llm")


def entry_key(checkpoint: str, options: dict) -> str:
    """The checkpoint's files (names, sizes, modification times), the build options, and
    the entry format and backend version (an entry of another version does not load)."""
    from backend.build_manifest import BACKEND_VERSION, FORMAT_VERSION
    h = hashlib.sha256(json.dumps([options, FORMAT_VERSION, BACKEND_VERSION], sort_keys=True).encode())
    h.update(os.path.abspath(checkpoint).encode())
    for root, _, files in sorted(os.walk(checkpoint)):
        for name in sorted(files):
            st = os.stat(os.path.join(root, name))
            h.update(f"{os.path.relpath(os.path.join(root, name), checkpoint)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def served_name(path: str) -> str:
    """A Triton model name from a folder's name (vLLM serves the path's name)."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", os.path.basename(os.path.normpath(path))).strip("-.")
    return name or "llm"


@contextlib.contextmanager
def _locked(path: str):
    """One builder of a cached folder at a time (another start waits, then reuses it)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build_once(final: str, done: str, make: Callable[[str], None]) -> bool:
    """Makes the folder `final` (complete once it holds `done`) with make(folder), once:
    under a lock, in a folder of its own moved into place whole, so that two starts at
    once build once and an interrupted build leaves nothing that is reused. Returns
    whether it was built now (False: it was there)."""
    with _locked(final):
        if os.path.isfile(os.path.join(final, done)):
            return False
        shutil.rmtree(final, ignore_errors=True)        # (an unfinished one, from an older version)
        staging = tempfile.mkdtemp(prefix=".building-", dir=os.path.dirname(final))
        try:
            make(staging)
            os.rename(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return True


def ensure_entry(checkpoint: str, name: str, options: dict, log=print, trtllm_models: bool = False) -> str:
    """The model repository holding `name` built from `checkpoint` with `options`:
    built on the first call, reused after (_build_once). `trtllm_models`: TensorRT-LLM's
    ensemble, tensorrt_llm_bls and tensorrt_llm beside it, in front of it."""
    from builder.build import BuildOptions, build
    key = {**options, "name": name, **({"trtllm_models": True} if trtllm_models else {})}
    repo = os.path.join(cache_root(), "repositories", entry_key(checkpoint, key))
    entry = os.path.join(repo, name)

    def make(staging: str) -> None:
        log(f"building {checkpoint} into {entry} (once: later starts reuse it)")
        build(BuildOptions.create(checkpoint=os.path.abspath(checkpoint), output=os.path.join(staging, name),
                                  name=name, link=True, perplexity=False, **options), log=lambda *_: None)
        if trtllm_models:
            from builder.trtllm_models import write_fronts
            write_fronts(staging, name)
    if not _build_once(repo, os.path.join(name, "config.pbtxt"), make):
        log(f"reusing the entry built before: {entry}")
    return repo


def trained_checkpoint() -> str:
    """The trained reference model's folder in the cache, unpacked once."""
    from builder.train_tiny import build_trained
    path = os.path.join(cache_root(), "checkpoints", "trained")
    _build_once(path, "config.json", build_trained)
    return path


def _serve(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="paged-llm serve", usage="paged-llm serve [PATH] [options]",
                                 description="Serve a Hugging Face checkpoint folder: PATH, first (as vLLM's model), "
                                             "or without it the trained reference model.",
                                 epilog="examples:\n  paged-llm serve ./Llama-3.2-1B --max-model-len 4096\n"
                                        "  API_KEY=... paged-llm serve ./Qwen3-0.6B --quantization fp8\n"
                                        "  paged-llm serve ./Llama-3.1-8B --speculative-config "
                                        "'{\"method\": \"eagle3\", \"model\": \"./EAGLE3-head\", "
                                        "\"num_speculative_tokens\": 4}'\n"
                                        "--host other than loopback exposes every port, Triton's inference too "
                                        "(docs/security.md): it needs a key.\nOther options go to the launcher "
                                        "(python -m clients.tritonserver serve --help).",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--served-model-name", help="the model's name for clients (default: the folder's name)")
    ap.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("OPENAI_PORT", 9000)), help="the OpenAI API")
    ap.add_argument("--api-key", help="the OpenAI API's key (better: API_KEY, which `ps` does not show)")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    ap.add_argument("--quantization", choices=("fp8", "int8", "int4", "w8a8"), help="weights built to this format")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "int8"), default="auto")
    ap.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None)
    ap.add_argument("--trtllm-models", action="store_true",
                    help="also serve TensorRT-LLM's ensemble, tensorrt_llm_bls and tensorrt_llm in front of the model "
                         "(what `make serve` serves; docs/migrating-from-tensorrt-llm-backend.md)")
    for flag, (field, typ) in BUILD_FLAGS.items():
        ap.add_argument(flag, dest=field, type=typ, metavar=flag[2:].upper().replace("-", "_"))
    # PATH comes first, as `vllm serve MODEL`: the launcher's options pass through unparsed,
    # so a value of one of them (--http-port 8000) must not be taken for it.
    path_arg = argv[0] if argv and not argv[0].startswith("-") else None
    args, launcher = ap.parse_known_args(argv[1:] if path_arg is not None else argv)
    args.path = path_arg
    options = {field: getattr(args, field) for field, _ in BUILD_FLAGS.values() if getattr(args, field) is not None}
    options.update(weights=args.quantization or args.dtype, kv_cache=args.kv_cache_dtype)
    if args.enable_prefix_caching is not None:
        options["enable_prefix_caching"] = args.enable_prefix_caching
    if args.api_key:
        os.environ["API_KEY"] = args.api_key
    from clients.tritonserver import is_loopback
    if not is_loopback(args.host) and not os.environ.get("API_KEY"):
        print(f"paged-llm serve: --host {args.host} exposes the server: set API_KEY (or --api-key)", file=sys.stderr)
        return 2
    name = args.served_model_name or ("llm" if args.path is None else served_name(args.path))
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        print(f"paged-llm serve: --served-model-name '{name}': letters, digits, '_', '.' and '-' only (a Triton "
              "model name; 'org/model' is not one)", file=sys.stderr)
        return 2
    from builder.trtllm_models import FRONTS
    if args.trtllm_models and name in FRONTS:
        print(f"paged-llm serve: --served-model-name '{name}' is one of the TensorRT-LLM models --trtllm-models "
              "adds: choose another name", file=sys.stderr)
        return 2
    path = args.path or trained_checkpoint()
    if not os.path.isfile(os.path.join(path, "config.json")):
        print(f"paged-llm serve: {path} is not a Hugging Face checkpoint folder (no config.json)", file=sys.stderr)
        return 2
    from builder.build import BuildError
    try:
        repo = ensure_entry(path, name, options, log=lambda m: print(m, flush=True), trtllm_models=args.trtllm_models)
    except (BuildError, ValueError) as e:
        print(f"paged-llm serve: {e}", file=sys.stderr)
        return 2
    from clients import tritonserver
    tritonserver.main(["serve", "--model-repository", repo, "--host", args.host, "--openai-port", str(args.port),
                       *launcher])
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = ["serve", *DELEGATES]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return _serve(rest)
    if command not in DELEGATES:
        print(f"paged-llm: unknown command '{command}' (one of: {', '.join(commands)})", file=sys.stderr)
        return 2
    module, prefix = DELEGATES[command]
    # Each in a process of its own (the benchmarks sit above the product: nothing imports them).
    return subprocess.call([sys.executable, "-m", module, *prefix, *rest])


if __name__ == "__main__":
    sys.exit(main())
