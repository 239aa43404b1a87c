"""python -m builder {tiny,build,default} ..."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from builder.build import BuildError, BuildOptions, build
from builder.plan import GPUS, KV_DTYPES, NAMED_CONFIGS, WEIGHT_DTYPES
from builder.tiny import build_tiny
from builder.trtllm_models import write_fronts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CHECKPOINT = os.path.join(ROOT, "models", "tiny-llama")
TRAINED_CHECKPOINT = os.path.join(ROOT, "models", "tiny-llama-trained")


def _plan(args) -> int:
    import json

    from backend.models.config import load_model_config, model_config_from_dict
    from builder import plan
    cfg = load_model_config(args.checkpoint) if args.checkpoint else model_config_from_dict(NAMED_CONFIGS[args.model])
    memory_gb, price = GPUS.get(args.gpu, (None, None))
    memory_gb = args.gpu_memory_gb or memory_gb
    price = args.gpu_price_per_hour if args.gpu_price_per_hour is not None else price
    if memory_gb is None or price is None:
        raise BuildError(f"unknown --gpu '{args.gpu}': name one of {', '.join(GPUS)} or give "
                         "--gpu-memory-gb and --gpu-price-per-hour")
    weights = args.weights or (["bf16", "mxfp4"] if cfg.mxfp4_experts else ["bf16", "fp8", "int8", "int4"])
    if "mxfp4" in weights and not cfg.mxfp4_experts:
        raise BuildError(f"invalid plan option 'weights': mxfp4 is for gpt-oss's MXFP4 checkpoints, "
                         f"not {cfg.architecture}")
    rows = plan.memory_rows(cfg, memory_gb, args.gpu_memory_utilization, weights, args.kv_cache, args.tp,
                            args.context_lens, args.block_size, args.max_num_seqs, args.pp, args.micro_batches,
                            kv_offloading_gb=args.kv_offloading_size, drafter=_plan_drafter(args.speculative))
    cost = plan.cost_plan(price, args.workload_tp * args.workload_pp, args.requests_per_day, args.input_tokens,
                          args.output_tokens, args.throughput, args.api_price_per_million)
    name = args.model or args.checkpoint
    params = plan.count_params(cfg)
    print(plan.format_report(name, f"{args.gpu} ({memory_gb:g} GiB, ${price:.2f}/h)", rows, cost, params))
    disagg = _disaggregation(args, cfg, weights[0], cost.replicas) if args.disaggregation else None
    if args.json:
        out = plan.as_json(name, args.gpu, rows, cost, params)
        if disagg is not None:
            out["disaggregation"] = disagg.as_dict()
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _plan_drafter(value: Optional[str]):
    from pydantic import ValidationError

    from backend.config import SpeculativeConfig
    from builder.build import speculative_value
    from builder.plan_draft import NONE, drafter
    if not value:
        return NONE
    try:
        return drafter(SpeculativeConfig.model_validate(speculative_value(value)))
    except (ValidationError, ValueError, OSError) as e:
        raise BuildError(f"invalid plan option 'speculative': {e}") from None


def _disaggregation(args, cfg, weights: str, replicas: int):
    from builder import plan_disagg
    if args.gpu not in plan_disagg.GPU_SPECS:
        raise BuildError(f"invalid plan option 'disaggregation': no compute and bandwidth figures for --gpu "
                         f"'{args.gpu}' (one of {', '.join(plan_disagg.GPU_SPECS)})")
    if not args.input_tokens or not args.requests_per_day:
        raise BuildError("invalid plan option 'disaggregation': give --input-tokens and --requests-per-day "
                         "(the workload it is estimated for)")
    rate = args.requests_per_day / 86400 / replicas
    e = plan_disagg.estimate_for(cfg, weights, args.kv_cache, args.gpu, args.input_tokens, rate,
                                 args.kv_link_gb_s, args.max_num_batched_tokens)
    print(plan_disagg.format_estimate(e, args.input_tokens, rate))
    return e


def _tiny(args) -> None:
    if args.vision:
        if args.trained or args.draft or args.eagle3 or args.medusa or args.train or args.ship:
            raise BuildError("--vision builds a random Qwen2-VL checkpoint: no other tiny option goes with it")
        from builder.tiny_vl import build_tiny_vision
        build_tiny_vision(args.output)
        return
    if not args.trained:
        if args.draft or args.eagle3 or args.medusa or args.train or args.ship:
            raise BuildError("--draft, --eagle3, --medusa, --train and --ship go with --trained")
        build_tiny(args.output)
        return
    if args.eagle3 or args.medusa:
        if args.draft + args.eagle3 + args.medusa > 1:
            raise BuildError("--draft, --eagle3 and --medusa are different drafters: pick one")
        from builder import train_eagle3, train_medusa
        module = train_eagle3 if args.eagle3 else train_medusa
        if not args.train:
            if args.ship:
                raise BuildError("--ship stores a run: it goes with --train")
            (train_eagle3.build_head if args.eagle3 else train_medusa.build_heads)(args.output)
            return
        module.train(args.output)
        if args.ship:
            module.write_shipped(args.output)
        return
    from builder import train_tiny
    spec = train_tiny.DRAFT if args.draft else train_tiny.TARGET
    if not args.train:
        if args.ship:
            raise BuildError("--ship stores a run: it goes with --train")
        train_tiny.build_trained(args.output, spec.name)
        return
    train_tiny.train(spec, args.output, eval_every=train_tiny.EVAL_EVERY)
    if args.ship:
        train_tiny.write_shipped(args.output, spec.name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m builder")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tiny", help="create the embedded default checkpoint (offline, deterministic)")
    t.add_argument("--output", required=True)
    t.add_argument("--trained", action="store_true", help="the trained reference model (default architecture, "
                   "trained on the bundled corpus; shipped weights: builder/train_tiny.py) instead of random weights")
    t.add_argument("--vision", action="store_true", help="a random Qwen2-VL checkpoint (images in chat; "
                   "builder/tiny_vl.py) instead of the default model")
    t.add_argument("--draft", action="store_true", help="with --trained: its 2-layer draft sibling")
    t.add_argument("--eagle3", action="store_true", help="with --trained: its EAGLE-3 head (speculative_config "
                   "method 'eagle3'; trained by builder/train_eagle3.py)")
    t.add_argument("--medusa", action="store_true", help="with --trained: its Medusa heads (speculative_config "
                   "method 'medusa'; trained by builder/train_medusa.py)")
    t.add_argument("--train", action="store_true", help="with --trained: train it again from the seed (CPU, "
                   "about 6 minutes of a quiet core) instead of unpacking the shipped weights")
    t.add_argument("--ship", action="store_true", help="with --train: store the result as the shipped weights "
                   "(builder/data/trained/)")

    b = sub.add_parser("build", help="checkpoint -> model-repository entry")
    b.add_argument("--checkpoint", required=True)
    b.add_argument("--output", required=True)
    b.add_argument("--name")
    b.add_argument("--weights", default="auto", help="auto | float32 | bfloat16 | float16 | fp8 | int8 | int4 | "
                   "w8a8 (INT8 weights and per-token INT8 activations, SmoothQuant)")
    b.add_argument("--activation-scheme", help="fp8: static (calibrated per-tensor scales, default) or dynamic "
                   "(per-token scales at run time)")
    b.add_argument("--smoothquant-alpha", type=float, help="w8a8: SmoothQuant migration strength in [0, 1] "
                   "(default 0.5)")
    b.add_argument("--group-size", type=int, help="int8/int4: input channels per scale (default 128; -1: per "
                   "output channel)")
    b.add_argument("--int-algorithm", help="int8/int4 rounding: rtn (round-to-nearest, default) or gptq "
                   "(GPTQ on the calibration text)")
    b.add_argument("--kv-cache", default="auto")
    b.add_argument("--engine", default="torch")
    b.add_argument("--link", action="store_true", help="point at the checkpoint instead of copying it")
    for flag, typ in (("--block-size", int), ("--num-kv-blocks", int), ("--kv-cache-memory-bytes", int),
                      ("--max-num-seqs", int), ("--max-num-batched-tokens", int), ("--max-model-len", int),
                      ("--max-queue-size", int), ("--grace-period-s", float), ("--tensor-parallel-size", int),
                      ("--pipeline-parallel-size", int), ("--nnodes", int), ("--kv-offloading-size", float)):
        b.add_argument(flag, type=typ)
    b.add_argument("--scheduling-policy", help="fcfs (default) or priority: requests admitted and preempted by "
                   "their `priority`, lower first (engine argument)")
    b.add_argument("--priority-aging-s", type=float, help="with --scheduling-policy priority: a request's priority "
                   "improves by one level per this many seconds it waits (engine argument)")
    b.add_argument("--lower-priority-prefill-tokens", type=int, help="with --scheduling-policy priority: prompt "
                   "tokens a step gives at most to requests ranked below the best one present (engine argument)")
    b.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None)
    b.add_argument("--no-perplexity", dest="perplexity", action="store_false", default=True,
                   help="skip the held-out perplexity of source and entry (computed by the engine for any "
                   "--weights other than auto)")
    for flag, typ in (("--max-n", int), ("--max-logprobs", int), ("--max-stop-strings", int),
                      ("--max-stop-string-len", int), ("--max-stop-token-ids", int), ("--max-guided-spec-bytes", int),
                      ("--guided-compile-timeout-s", float), ("--request-timeout-s", float)):
        b.add_argument(flag, type=typ, help="per-request limit (engine argument: docs/reference/configuration.md)")
    b.add_argument("--limit-mm-per-prompt", help="vision-language models: items per prompt by modality as JSON, "
                   "e.g. '{\"image\": 4}' (vLLM's limit_mm_per_prompt; default 16 images)")
    for flag, typ in (("--max-image-bytes", int), ("--max-image-pixels", int), ("--max-num-encoder-input-tokens", int),
                      ("--encoder-cache-size", int)):
        b.add_argument(flag, type=typ, help="vision-language models: image limit or encoder budget (engine argument)")
    b.add_argument("--calibration-data", help="text file, one calibration prompt per line (fp8, w8a8, gptq; "
                   "default: built-in text)")
    b.add_argument("--speculative", help="speculative decoding, vLLM's speculative_config as JSON, e.g. "
                   "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' or "
                   "'{\"method\": \"draft_model\", \"model\": \"/ckpt/draft\", \"num_speculative_tokens\": 4}', "
                   "or the shorthand METHOD[:PATH[:K]]: 'eagle3:/ckpt/head' (an EAGLE-3 head, copied into the "
                   "entry), 'draft_model:/ckpt/draft:4', 'ngram:4' (K defaults to 3)")
    b.add_argument("--runner", choices=["generate", "pooling"],
                   help="pooling: an embedding model served by /v1/embeddings (vLLM's --runner pooling)")
    b.add_argument("--pooler-config", help="with --runner pooling, vLLM's pooler_config as JSON (default "
                   "'{\"pooling_type\": \"LAST\", \"normalize\": true}'; pooling_type LAST or MEAN)")
    b.add_argument("--lora", dest="lora_modules", action="append", metavar="NAME=FOLDER",
                   help="a LoRA adapter (PEFT folder) to serve under NAME; repeat for more")
    b.add_argument("--max-loras", type=int, help="adapters resident on the device at once (default 1)")
    b.add_argument("--max-lora-rank", type=int, help="the largest adapter rank (default 16)")
    b.add_argument("--gpu-memory-gb", type=float, help="memory plan: device memory (default 80)")
    b.add_argument("--plan-seq-len", type=int, help="memory plan: sequence length (default 4096)")

    p = sub.add_parser("plan", help="capacity and cost: memory per dtype and TP size, replicas, $/month")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a checkpoint folder (its config.json)")
    src.add_argument("--model", help="a named config: " + ", ".join(NAMED_CONFIGS))
    p.add_argument("--gpu", default="H100-80GB", help="one of: " + ", ".join(GPUS))
    p.add_argument("--gpu-memory-gb", type=float, help="instead of the named GPU's")
    p.add_argument("--gpu-price-per-hour", type=float, help="instead of the named GPU's on-demand price")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--weights", nargs="+", choices=list(WEIGHT_DTYPES),
                   help="default: bf16 fp8 int8 int4 (gpt-oss's MXFP4 checkpoints: bf16 mxfp4)")
    p.add_argument("--kv-cache", default="bf16", choices=list(KV_DTYPES))
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--pp", type=int, nargs="+", default=[1], help="pipeline stages (each of --tp GPUs)")
    p.add_argument("--micro-batches", type=int, help="batches in flight, for the pipeline bubble (default: each "
                   "row's P, as the engine's max_concurrent_batches)")
    p.add_argument("--context-lens", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-offloading-size", type=float, help="GiB of host memory for the KV tier (the engine "
                   "argument): adds the tokens it holds to each row")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--speculative", help="a speculative drafter whose weights and K/V each row adds, as "
                   "`build --speculative` takes it ('eagle3:/ckpt/head', 'draft_model:/ckpt/draft', JSON)")
    p.add_argument("--requests-per-day", type=float, default=0.0)
    p.add_argument("--input-tokens", type=int, default=0)
    p.add_argument("--output-tokens", type=int, default=0)
    p.add_argument("--throughput", type=float, help="output tokens/s one replica sustains (measured)")
    p.add_argument("--workload-tp", type=int, default=1, help="GPUs per replica for the cost rows")
    p.add_argument("--workload-pp", type=int, default=1, help="pipeline stages per replica for the cost rows")
    p.add_argument("--api-price-per-million", type=float)
    p.add_argument("--disaggregation", action="store_true",
                   help="estimate whether prefill/decode disaggregation pays for the workload (docs/dynamo.md)")
    p.add_argument("--kv-link-gb-s", type=float, default=50.0,
                   help="with --disaggregation: GB/s between a prefill and a decode worker (default 50: one "
                        "400 Gb/s InfiniBand link)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="with --disaggregation: the step budget that chunks an aggregated replica's prompts")
    p.add_argument("--json", help="also write the plan here")

    d = sub.add_parser("default", help="make sure model_repository/llm holds the default model, with "
                                        "TensorRT-LLM's ensemble, tensorrt_llm_bls and tensorrt_llm in front of it")
    d.add_argument("--repository", default="model_repository")
    d.add_argument("--force", action="store_true")
    d.add_argument("--trained", action="store_true", help="the trained reference model (models/tiny-llama-trained) "
                   "instead of the random-weight default")

    f = sub.add_parser("trtllm-models", help="add TensorRT-LLM's ensemble, tensorrt_llm_bls and tensorrt_llm "
                                             "entries in front of a model of a repository")
    f.add_argument("--repository", default="model_repository")
    f.add_argument("--llm-model", default="llm", help="the model they forward to")
    f.add_argument("--max-batch-size", type=int, default=64)
    f.add_argument("--instances", type=int, default=4, help="requests each entry streams at once")
    f.add_argument("--force", action="store_true")

    args = ap.parse_args(argv)
    try:
        if args.cmd == "tiny":
            _tiny(args)
            print(f"wrote {args.output}")
        elif args.cmd == "plan":
            return _plan(args)
        elif args.cmd == "trtllm-models":
            written = write_fronts(args.repository, args.llm_model, args.max_batch_size, args.force, args.instances)
            print(f"wrote {', '.join(written) or 'nothing (entries exist; --force rewrites)'} in {args.repository}")
        elif args.cmd == "build":
            kw = {k: v for k, v in vars(args).items() if k != "cmd" and v is not None}
            build(BuildOptions.create(**kw))
        else:
            target = os.path.join(args.repository, "llm")
            write_fronts(args.repository, "llm", force=args.force)
            checkpoint = TRAINED_CHECKPOINT if args.trained else DEFAULT_CHECKPOINT
            if os.path.isfile(os.path.join(target, "config.pbtxt")) and not args.force \
                    and _built_from(target) == os.path.abspath(checkpoint):
                print(f"{target} exists")
                return 0
            if not os.path.isfile(os.path.join(checkpoint, "config.json")):
                if args.trained:
                    from builder.train_tiny import build_trained
                    build_trained(checkpoint)
                else:
                    build_tiny(checkpoint)
            build(BuildOptions.create(checkpoint=checkpoint, output=target, name="llm",
                                      num_kv_blocks=1024, max_num_seqs=64, max_num_batched_tokens=512,
                                      max_queue_size=256))
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _built_from(entry: str):
    """The checkpoint an entry was built from (its build manifest), or None. The default
    model is rebuilt when the other one (trained or random) is asked for."""
    try:
        with open(os.path.join(entry, "build_manifest.json")) as f:
            return os.path.abspath(json.load(f)["options"]["checkpoint"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


if __name__ == "__main__":
    sys.exit(main())
