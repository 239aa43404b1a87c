"""`python -m builder build`: a local Hugging Face checkpoint -> a Triton model-repository
entry (config.pbtxt, version folder, checkpoint, build manifest)."""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Literal, Optional

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from backend.build_manifest import BACKEND_VERSION, FORMAT_VERSION, MANIFEST_NAME
from backend.config import EngineArgs, PoolerConfig, SpeculativeConfig, json_or_value, lora_modules_value, validated
from backend.models.architectures import ARCHITECTURES
from backend.models.config import load_model_config
from backend.models.quant_linears import describe as describe_quantization
from backend.parallel.pipeline import check_pipeline_parallel
from backend.parallel.sharding import check_tensor_parallel
from backend.triton_server.serving_config import render_parameters
from builder.entry_files import (BuildError, checkpoint_hash, copy_checkpoint, place_adapters, place_draft,
                                 write_fp8_checkpoint)
from builder.plan import format_plan, memory_plan
from builder.plan_vision import vision_plan

BACKEND_NAME = "paged_llm"
# Engine arguments passed through as they are (checked by EngineArgs).
# Builds that quantize the checkpoint (and write a quality report).
QUANTIZED_WEIGHTS = ("fp8", "int8", "int4", "w8a8")
REQUEST_LIMITS = ("max_n", "max_logprobs", "max_stop_strings", "max_stop_string_len", "max_stop_token_ids",
                  "max_guided_spec_bytes", "guided_compile_timeout_s", "request_timeout_s",
                  # vision-language models' image limits and encoder budget
                  "limit_mm_per_prompt", "max_image_bytes", "max_image_pixels", "max_num_encoder_input_tokens",
                  "encoder_cache_size")


def speculative_value(v):
    """`--speculative`: vLLM's speculative_config as JSON, or the shorthand METHOD[:PATH[:K]]
    (`eagle3:/ckpt/head`, `draft_model:/ckpt/draft:4`, `ngram`; K defaults to 3)."""
    if not isinstance(v, str) or v.lstrip().startswith("{") or not v.strip():
        return json_or_value(v)
    method, _, rest = v.strip().partition(":")
    path, k = rest, 3
    head, _, tail = rest.rpartition(":")
    if head and tail.isdigit():
        path, k = head, int(tail)
    elif not head and tail.isdigit() and method == "ngram":
        path, k = "", int(tail)
    return {"method": method, "num_speculative_tokens": k, **({"model": path} if path else {})}


class BuildOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint: str
    output: str
    name: Optional[str] = None
    weights: Literal["auto", "float32", "bfloat16", "float16", "fp8", "int8", "int4", "w8a8"] = "auto"
    # fp8: activation scales static (calibrated, per tensor) or dynamic (per token at run time).
    activation_scheme: Literal["static", "dynamic"] = "static"
    # w8a8: SmoothQuant's migration strength (0: all of the activation range stays, 1: all
    # of it moves into the weights).
    smoothquant_alpha: float = Field(0.5, ge=0, le=1)
    # int8 / int4 (weight-only, compressed-tensors pack-quantized): input channels per
    # scale; -1: one scale per output channel.
    group_size: int = Field(128, ge=-1)
    # int8 / int4 rounding: round-to-nearest, or GPTQ on calibration text.
    int_algorithm: Literal["rtn", "gptq"] = "rtn"
    # fp8: E4M3 with per-layer scales (from an FP8 build); int8: per-KV-head scales
    # calibrated here (builder/kv_int8.py), stored in the entry.
    kv_cache: Literal["auto", "fp8", "int8"] = "auto"
    # torch: the engine runs the checkpoint. onnxruntime: also export the reference graph
    # and serve it with onnxruntime (CPU check of the export). tensorrt: export the plugin
    # graph and build a TensorRT engine from it (needs TensorRT and a GPU).
    engine: Literal["torch", "onnxruntime", "tensorrt"] = "torch"
    link: bool = False
    # Engine settings written into config.pbtxt.
    block_size: int = Field(16, ge=1)
    num_kv_blocks: Optional[int] = Field(None, ge=1)
    kv_cache_memory_bytes: Optional[int] = Field(None, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(512, ge=1)
    max_model_len: Optional[int] = Field(None, ge=1)
    enable_prefix_caching: bool = True
    max_queue_size: Optional[int] = Field(None, ge=0)
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    priority_aging_s: Optional[float] = Field(None, gt=0)
    lower_priority_prefill_tokens: Optional[int] = Field(None, ge=1)
    kv_offloading_size: Optional[float] = Field(None, gt=0)     # GiB of host memory for the KV tier
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    # Machines the ranks span (the others run `python -m backend.parallel.node`).
    nnodes: int = Field(1, ge=1)
    # The engine's speculative_config (JSON). A draft model's checkpoint is copied into
    # the entry (`draft/`), or pointed at with `link`.
    speculative: Optional[SpeculativeConfig] = None
    # LoRA adapters (PEFT folders) by name, copied into the entry (`loras/<name>/`) or
    # pointed at with `link`; and the engine's slots for them.
    lora_modules: dict[str, str] = Field(default_factory=dict)
    # An embedding model (vLLM's `--runner pooling` and `--pooler-config`): served by
    # /v1/embeddings, each request's result the pooled final hidden state (Triton output
    # `embedding`), nothing generated. pooler_config: {"pooling_type": "LAST"|"MEAN",
    # "normalize": true}; LAST (Qwen3-Embedding) and normalized by default.
    runner: Literal["generate", "pooling"] = "generate"
    pooler_config: Optional[PoolerConfig] = None
    max_loras: int = Field(1, ge=1)
    max_lora_rank: int = Field(16, ge=1)
    # Per-request limits (engine arguments of the same names); None: the engine's default.
    max_n: Optional[int] = None
    max_logprobs: Optional[int] = None
    max_stop_strings: Optional[int] = None
    max_stop_string_len: Optional[int] = None
    max_stop_token_ids: Optional[int] = None
    max_guided_spec_bytes: Optional[int] = None
    guided_compile_timeout_s: Optional[float] = None
    request_timeout_s: Optional[float] = None
    # Vision-language models (engine arguments of the same names); None: the engine's default.
    limit_mm_per_prompt: Optional[dict[str, int]] = None
    max_image_bytes: Optional[int] = None
    max_image_pixels: Optional[int] = None
    max_num_encoder_input_tokens: Optional[int] = None
    encoder_cache_size: Optional[int] = None
    grace_period_s: float = Field(10.0, ge=0)
    # Held-out perplexity of the source and of the built entry, both computed by the
    # engine (builder/perplexity.py), for a build that sets the weights' format. On by
    # default from the command line (`--no-perplexity`); off by default here, so that
    # callers that build many entries (tests) do not pay two engine runs per build.
    perplexity: bool = False
    calibration_data: Optional[str] = None
    # Memory plan: device memory and sequence length to size for.
    gpu_memory_gb: float = Field(80.0, gt=0)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    plan_seq_len: int = Field(4096, ge=1)

    _speculative_json = field_validator("speculative", mode="before")(lambda v: speculative_value(v))
    _pooler_json = field_validator("pooler_config", mode="before")(lambda v: json_or_value(v))
    _lora_modules = field_validator("lora_modules", mode="before")(lambda v: lora_modules_value(v))
    _mm_limit_json = field_validator("limit_mm_per_prompt", mode="before")(lambda v: json_or_value(v))

    @field_validator("calibration_data")
    @classmethod
    def _calibration_file(cls, path: Optional[str]) -> Optional[str]:
        if path is None:
            return path
        if not os.path.isfile(path):
            raise ValueError(f"calibration_data file '{path}' does not exist")
        with open(path, encoding="utf-8") as f:
            if not any(line.strip() for line in f):
                raise ValueError(f"'{path}' has no non-empty line (one calibration prompt per line)")
        return path

    @field_validator(*REQUEST_LIMITS)
    @classmethod
    def _engine_limit(cls, v: Optional[float], info: ValidationInfo) -> Optional[float]:
        if v is not None:               # the engine's own check, before anything is written
            try:
                EngineArgs(model="-", **{info.field_name: v})
            except ValidationError as e:
                raise ValueError(e.errors()[0]["msg"].removeprefix("Value error, ")) from None
        return v

    @model_validator(mode="after")
    def _check(self) -> "BuildOptions":
        if not os.path.isfile(os.path.join(self.checkpoint, "config.json")):
            raise ValueError(f"checkpoint '{self.checkpoint}' has no config.json")
        if self.int_algorithm == "gptq" and self.weights not in ("int8", "int4"):
            raise ValueError(f"int_algorithm=gptq is for weights int8 or int4, not {self.weights}")
        if (self.calibration_data is not None and self.weights not in ("fp8", "w8a8")
                and self.int_algorithm != "gptq" and self.kv_cache != "int8"):
            raise ValueError("calibration_data is only used with weights=fp8, weights=w8a8, int_algorithm=gptq "
                             "or kv_cache=int8")
        if self.kv_cache == "int8" and self.engine != "torch":
            raise ValueError(f"kv_cache=int8 runs in the torch engine's attention: the {self.engine} graph's "
                             "PagedAttention node has no per-head scales; use engine=torch")
        if self.activation_scheme != "static" and self.weights != "fp8":
            raise ValueError(f"activation_scheme={self.activation_scheme} is for weights fp8, not {self.weights}")
        if "smoothquant_alpha" in self.model_fields_set and self.weights != "w8a8":
            raise ValueError(f"smoothquant_alpha is for weights w8a8, not {self.weights}")
        if self.engine != "torch" and (self.weights == "w8a8" or self.activation_scheme == "dynamic"):
            raise ValueError(f"engine={self.engine} exports static FP8 Q/DQ graphs: weights w8a8 and dynamic "
                             "activation scales run with engine torch")
        if self.pooler_config is not None and self.runner != "pooling":
            raise ValueError("pooler_config is for runner=pooling")
        if self.runner == "pooling":
            off = (f"engine={self.engine}" if self.engine != "torch" else "speculative" if self.speculative else
                   "lora_modules" if self.lora_modules else
                   f"tensor_parallel_size={self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else
                   f"pipeline_parallel_size={self.pipeline_parallel_size}" if self.pipeline_parallel_size > 1
                   else None)
            if off:
                raise ValueError(f"runner=pooling runs the torch model on one rank: it takes no {off}")
        return self

    @classmethod
    def create(cls, **kw) -> "BuildOptions":
        return validated(cls, BuildError, "build option", **kw)


def engine_parameters(opts: BuildOptions, model_path: str, draft_path: Optional[str] = None,
                      lora_paths: Optional[dict[str, str]] = None) -> dict:
    dtype = opts.weights if opts.weights in ("float32", "bfloat16", "float16") else "auto"
    values = dict(model=model_path, dtype=dtype, block_size=opts.block_size, num_kv_blocks=opts.num_kv_blocks,
                  kv_cache_memory_bytes=opts.kv_cache_memory_bytes, max_num_seqs=opts.max_num_seqs,
                  max_num_batched_tokens=opts.max_num_batched_tokens, max_model_len=opts.max_model_len,
                  enable_prefix_caching=opts.enable_prefix_caching, max_queue_size=opts.max_queue_size,
                  scheduling_policy=opts.scheduling_policy, priority_aging_s=opts.priority_aging_s,
                  lower_priority_prefill_tokens=opts.lower_priority_prefill_tokens,
                  kv_offloading_size=opts.kv_offloading_size,
                  kv_cache_dtype=opts.kv_cache, tensor_parallel_size=opts.tensor_parallel_size,
                  pipeline_parallel_size=opts.pipeline_parallel_size, nnodes=opts.nnodes)
    if opts.kv_cache == "int8":
        from builder.kv_int8 import KV_SCALES_FILE
        values["kv_cache_scales"] = KV_SCALES_FILE
    if opts.speculative is not None:
        spec = opts.speculative.model_dump(exclude_none=True)
        if draft_path is not None:
            spec["model"] = draft_path
        values["speculative_config"] = spec
    values.update({k: getattr(opts, k) for k in REQUEST_LIMITS if getattr(opts, k) is not None})
    if opts.runner == "pooling":
        values["runner"] = "pooling"
        values["pooler_config"] = (opts.pooler_config or PoolerConfig()).model_dump()
    if opts.lora_modules:
        values.update(lora_modules=lora_paths or dict(opts.lora_modules), max_loras=opts.max_loras,
                      max_lora_rank=opts.max_lora_rank)
    # The same validation the backend runs at load, before anything is written.
    EngineArgs.create(**values)
    return values


def render_config(name: str, params: dict) -> str:
    return "\n".join([
        f'name: "{name}"',
        f'backend: "{BACKEND_NAME}"',
        "max_batch_size: 0",
        "model_transaction_policy { decoupled: true }",
        "# KIND_MODEL: the engine places itself (CUDA when present, else CPU).",
        "instance_group [ { count: 1 kind: KIND_MODEL } ]",
        "# Inputs and outputs are filled in by the backend (auto-complete): the vLLM backend's",
        "# contract plus TensorRT-LLM's scalar inputs: docs/reference/triton-io.md.",
        render_parameters(params),
        "",
    ])


class Stages:
    """One progress bar per build stage (load, calibrate, quantize, export, build, write)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._bar = None

    def __call__(self, name: str, steps: int):
        from tqdm import tqdm
        if self._bar is not None:
            self._bar.close()
        self._bar = tqdm(total=steps, desc=f"{name:>9}", disable=not self.enabled, leave=True, ncols=80)
        return lambda n=1: self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _calibration_texts(opts: BuildOptions) -> tuple[list[str], list[str]]:
    """(calibration prompts, held-out texts for the quality report): the built-in corpus,
    or one prompt per line of --calibration-data (checked non-empty by BuildOptions)."""
    from builder.fp8 import default_texts
    calib, held = default_texts()
    if opts.calibration_data:
        with open(opts.calibration_data, encoding="utf-8") as f:
            calib = [line.strip() for line in f if line.strip()]
    return calib, held


def build(opts: BuildOptions, log=print, progress: bool = True) -> str:
    t0 = time.time()
    cfg = load_model_config(opts.checkpoint)  # fails early on unsupported architectures
    problem = check_tensor_parallel(cfg, opts.tensor_parallel_size)
    if problem:
        raise BuildError(f"invalid build option 'tensor_parallel_size': {opts.tensor_parallel_size} ({problem})")
    problem = check_pipeline_parallel(cfg, opts.pipeline_parallel_size)
    if problem:
        raise BuildError(f"invalid build option 'pipeline_parallel_size': {opts.pipeline_parallel_size} ({problem})")
    if cfg.moe is not None and opts.engine != "torch":
        raise BuildError(f"invalid build option 'engine': {opts.engine} graphs of mixture-of-experts checkpoints "
                         f"({cfg.architecture}) are not supported yet; use engine 'torch'")
    # FP8 experts: Mixtral, Qwen2-MoE, Qwen3-MoE (gpt-oss ships MXFP4 and has biased experts).
    moe_fp8 = opts.weights == "fp8" and cfg.moe is not None and cfg.architecture != "GptOssForCausalLM"
    if cfg.moe is not None and opts.weights in QUANTIZED_WEIGHTS and not moe_fp8:
        raise BuildError(f"invalid build option 'weights': {opts.weights} is not supported for mixture-of-experts "
                         f"checkpoints ({cfg.architecture}) yet; build float32, bfloat16 or float16"
                         + ("" if cfg.architecture == "GptOssForCausalLM" else " (or fp8)"))
    if moe_fp8 and opts.tensor_parallel_size > 1:
        raise BuildError(f"invalid build option 'tensor_parallel_size': {opts.tensor_parallel_size} (FP8 "
                         "mixture-of-experts builds run on one rank)")
    vision = ARCHITECTURES[cfg.architecture].vision
    if vision and opts.weights == "w8a8":
        raise BuildError(f"invalid build option 'weights': w8a8 is not supported for vision-language "
                         f"checkpoints ({cfg.architecture}) yet; build fp8, int8 or int4 (the language model's "
                         "projections) or the source's dtype")
    if vision and opts.engine != "torch":
        raise BuildError(f"invalid build option 'engine': {opts.engine} graphs take token ids only; "
                         f"{cfg.architecture} reads images: use engine 'torch'")
    quant = cfg.quantization or {}
    if opts.engine != "torch" and quant and (quant.get("quant_method") != "paged_llm_fp8"
                                             or quant.get("activation_scheme") == "dynamic"):
        raise BuildError(f"invalid build option 'engine': {opts.engine} exports static FP8 Q/DQ graphs only; the "
                         f"checkpoint is {describe_quantization(quant)}: use engine 'torch'")
    if cfg.quantization is not None and opts.weights in QUANTIZED_WEIGHTS:
        raise BuildError(f"checkpoint '{opts.checkpoint}' is already quantized "
                         f"({cfg.quantization.get('quant_method')})")
    name = opts.name or os.path.basename(os.path.normpath(opts.output))
    out = opts.output
    stages = Stages(progress)
    os.makedirs(os.path.join(out, "1"), exist_ok=True)
    ckpt_dst = os.path.join(out, "checkpoint")
    quality = None
    calib, held = _calibration_texts(opts)
    if opts.weights == "fp8":
        from builder.fp8 import quantize_checkpoint
        state, qcfg, quality = quantize_checkpoint(opts.checkpoint, calib, held, stages, opts.activation_scheme)
        advance = stages("write", 2)
        write_fp8_checkpoint(opts.checkpoint, ckpt_dst, state, qcfg)
        advance()
        model_path = "checkpoint"
    elif opts.weights in ("int8", "int4"):
        from builder.int_quant import quantize_int_checkpoint
        try:
            quality = quantize_int_checkpoint(opts.checkpoint, ckpt_dst, 8 if opts.weights == "int8" else 4,
                                              opts.group_size, held, stages, opts.int_algorithm, calib)
        except ImportError as e:
            raise BuildError(f"--weights {opts.weights} writes the compressed-tensors format with its library: "
                             f"pip install compressed-tensors==0.20.0 ({e})") from None
        except ValueError as e:
            raise BuildError(f"invalid build option 'group_size': {e}") from None
        advance = stages("write", 1)
        model_path = "checkpoint"
    elif opts.weights == "w8a8":
        from builder.w8a8 import quantize_w8a8_checkpoint
        try:
            quality = quantize_w8a8_checkpoint(opts.checkpoint, ckpt_dst, calib, held, stages, opts.smoothquant_alpha)
        except ValueError as e:
            raise BuildError(f"invalid build option 'weights': w8a8: {e}") from None
        advance = stages("write", 1)
        model_path = "checkpoint"
    elif opts.link:
        model_path = os.path.abspath(opts.checkpoint)
        advance = stages("write", 1)
    else:
        advance = stages("write", 2)
        model_path = "checkpoint"
        copy_checkpoint(opts.checkpoint, ckpt_dst)
        advance()
    if opts.kv_cache == "int8":
        from builder.kv_int8 import write_kv_int8_scales
        try:
            write_kv_int8_scales(opts.checkpoint, out, _calibration_texts(opts)[0], stages)
        except (ImportError, ValueError, OSError) as e:     # e.g. a quantized checkpoint transformers cannot load here
            raise BuildError(f"invalid build option 'kv_cache': int8 calibrates on '{opts.checkpoint}' in "
                             f"transformers, which failed: {e}") from None
    import torch
    served = os.path.join(out, model_path) if not os.path.isabs(model_path) else model_path
    wbytes = sum(os.path.getsize(os.path.join(served, f)) for f in os.listdir(served) if f.endswith(".safetensors"))
    source_dtype = opts.weights in ("auto", "int8", "int4", "w8a8")      # INT computes in the source's dtype
    kv_elem = 1 if opts.kv_cache in ("fp8", "int8") else (4 if (opts.weights == "float32" or (source_dtype
                                                      and cfg.torch_dtype == "float32")) else 2)
    vision = vision_plan(served, cfg, opts.max_num_batched_tokens, opts.max_num_encoder_input_tokens,
                         opts.encoder_cache_size, 4 if kv_elem == 4 else 2)
    plan = memory_plan(cfg, wbytes, kv_elem, opts, vision)
    params = engine_parameters(opts, model_path, place_draft(opts, out), place_adapters(opts, cfg, out))
    if opts.engine != "torch" and cfg.attn_logit_softcap:
        raise BuildError(f"invalid build option 'engine': '{opts.engine}' exports a graph whose attention (the "
                         "PagedAttention node, the TensorRT plugin) has no soft-capping yet; "
                         f"{cfg.architecture} needs it: use --engine torch")
    if opts.engine != "torch":
        params.update(_export_graph(opts, served, cfg, plan, stages, log))
    params["grace_period_s"] = opts.grace_period_s
    with open(os.path.join(out, "config.pbtxt"), "w") as f:
        f.write(render_config(name, params))
    perplexity = None
    if opts.perplexity and opts.weights != "auto" and opts.engine == "torch" and opts.runner == "generate":
        from builder.perplexity import build_perplexity
        advance()                         # written but for the manifest, which gets the figures
        advance = stages("perplexity", 1)
        perplexity = build_perplexity(opts.checkpoint, out, held)
    manifest = {
        "format_version": FORMAT_VERSION,
        "backend_version": BACKEND_VERSION,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "options": opts.model_dump(),
        "architecture": cfg.architecture,
        "source_checkpoint": os.path.abspath(opts.checkpoint),
        "source_checkpoint_sha256": checkpoint_hash(opts.checkpoint),
        "versions": {"torch": torch.__version__, "python": platform.python_version(),
                     "triton": _version("triton"), "tensorrt": _version("tensorrt"),
                     "transformers": _version("transformers")},
        "memory_plan": plan,
        "speculative_config": params.get("speculative_config"),
        "lora_modules": params.get("lora_modules"),
        "quality": None if quality is None and perplexity is None else {
            **({} if quality is None else {
                "held_out_tokens": quality.held_out_tokens, "relative_logit_error": quality.relative_logit_error,
                "top1_agreement": quality.top1_agreement}),
            **({} if perplexity is None else {"perplexity": perplexity})},
    }
    with open(os.path.join(out, MANIFEST_NAME), "w") as f:
        json.dump(manifest, f, indent=2)
    advance()
    stages.close()
    log(format_plan(plan))
    if quality is not None:
        log(f"{opts.weights.upper()} quality on {quality.held_out_tokens} held-out tokens: relative logit error "
            f"{quality.relative_logit_error:.4f}, top-1 agreement {quality.top1_agreement:.4f}")
    if perplexity is not None:
        log(f"held-out perplexity (engine, {perplexity['held_out_tokens']} tokens): source "
            f"{perplexity['source_perplexity']:.3f}, {opts.weights} {perplexity['perplexity']:.3f}")
    log(f"wrote {out} ({cfg.architecture}, backend '{BACKEND_NAME}', weights {opts.weights}, "
        f"kv cache {opts.kv_cache}) in {time.time() - t0:.1f}s")
    return out


def _export_graph(opts: BuildOptions, checkpoint: str, cfg, plan: dict, stages: "Stages", log) -> dict:
    """Export the decoder graph for the chosen engine; for TensorRT, build model.plan when
    TensorRT is importable, else stop, leaving the ONNX and the exact build command.
    Returns the engine parameters that select the graph runner."""
    from builder.onnx_export import export
    out = opts.output
    advance = stages("export", 1)
    if opts.engine == "onnxruntime":
        export(checkpoint, os.path.join(out, "1", "model.onnx"), "reference", block_size=opts.block_size)
        advance()
        return {"model_runner": "onnxruntime", "model_graph": "1/model.onnx"}
    from builder.tensorrt_engine import ProfileLimits, build_engine, command
    onnx_path = export(checkpoint, os.path.join(out, "onnx", "model.onnx"), "plugin", kv_fp8=opts.kv_cache == "fp8",
                       block_size=opts.block_size)
    advance()
    max_len = opts.max_model_len or cfg.max_position_embeddings
    # The engine's pools are exactly this size (the plan's profile fixes it): from the
    # memory plan unless given.
    num_blocks = opts.num_kv_blocks or max(1, plan["kv_tokens"] // opts.block_size)
    limits = ProfileLimits(opts.max_num_batched_tokens, opts.max_num_seqs, max_len, opts.block_size, num_blocks)
    plan_path = os.path.join(out, "1", "model.plan")
    cmd = command(os.path.abspath(onnx_path), os.path.abspath(plan_path), limits)
    with open(os.path.join(out, "onnx", "BUILD_COMMAND.txt"), "w") as f:
        f.write(cmd + "\n")
    try:
        import tensorrt  # noqa: F401  (optional extra, imported lazily)
    except ImportError as e:
        stages.close()
        raise BuildError(f"exported {onnx_path} (one PagedAttention node per layer); stopping before the "
                         f"engine build: TensorRT is not installed ({e}). On a machine with TensorRT and a GPU, "
                         f"run: {cmd}") from None
    advance = stages("build", 1)
    try:
        build_engine(onnx_path, plan_path, limits, log)
    except RuntimeError as e:
        raise BuildError(str(e)) from None
    advance()
    return {"model_runner": "tensorrt", "model_graph": "1/model.plan", "num_kv_blocks": num_blocks}


def _version(pkg: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(pkg)
    except PackageNotFoundError:
        return None
