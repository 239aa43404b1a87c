"""`python -m builder build`: a local Hugging Face checkpoint -> a Triton model-repository
entry (config.pbtxt, version folder, checkpoint, build manifest)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import time
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from backend.build_manifest import BACKEND_VERSION, FORMAT_VERSION, MANIFEST_NAME
from backend.config import EngineArgs, format_validation_error
from backend.models.config import load_model_config
from backend.triton_server.serving_config import render_parameters

BACKEND_NAME = "paged_llm"
CHECKPOINT_FILES = (".json", ".safetensors", ".model", ".txt", ".tiktoken")


class BuildError(ValueError):
    pass


class BuildOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint: str
    output: str
    name: Optional[str] = None
    weights: Literal["auto", "float32", "bfloat16", "float16", "fp8"] = "auto"
    kv_cache: Literal["auto", "fp8"] = "auto"
    engine: Literal["torch", "tensorrt"] = "torch"
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
    grace_period_s: float = Field(10.0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> "BuildOptions":
        if not os.path.isfile(os.path.join(self.checkpoint, "config.json")):
            raise ValueError(f"checkpoint '{self.checkpoint}' has no config.json")
        return self

    @classmethod
    def create(cls, **kw) -> "BuildOptions":
        try:
            return cls(**kw)
        except ValidationError as e:
            raise BuildError(format_validation_error(e, "build option")) from None


def checkpoint_hash(path: str) -> str:
    """sha256 over the names and sizes and the config; cheap enough for large checkpoints."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            h.update(f"{name}:{os.path.getsize(full)};".encode())
    with open(os.path.join(path, "config.json"), "rb") as f:
        h.update(f.read())
    return h.hexdigest()


def engine_parameters(opts: BuildOptions, model_path: str) -> dict:
    dtype = opts.weights if opts.weights in ("float32", "bfloat16", "float16") else "auto"
    values = dict(model=model_path, dtype=dtype, block_size=opts.block_size, num_kv_blocks=opts.num_kv_blocks,
                  kv_cache_memory_bytes=opts.kv_cache_memory_bytes, max_num_seqs=opts.max_num_seqs,
                  max_num_batched_tokens=opts.max_num_batched_tokens, max_model_len=opts.max_model_len,
                  enable_prefix_caching=opts.enable_prefix_caching, max_queue_size=opts.max_queue_size,
                  kv_cache_dtype=opts.kv_cache)
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
        "# contract plus TensorRT-LLM's scalar inputs. See README.",
        render_parameters(params),
        "",
    ])


def build(opts: BuildOptions, log=print) -> str:
    if opts.engine == "tensorrt":
        raise BuildError("--engine tensorrt is not available in this build: TensorRT cannot be installed "
                         "here. See README ('What was verified where').")
    if opts.weights == "fp8":
        raise BuildError("--weights fp8 is not implemented yet; see README ('Status').")
    t0 = time.time()
    cfg = load_model_config(opts.checkpoint)  # fails early on unsupported architectures
    name = opts.name or os.path.basename(os.path.normpath(opts.output))
    out = opts.output
    os.makedirs(os.path.join(out, "1"), exist_ok=True)
    ckpt_dst = os.path.join(out, "checkpoint")
    if opts.link:
        model_path = os.path.abspath(opts.checkpoint)
    else:
        model_path = "checkpoint"
        os.makedirs(ckpt_dst, exist_ok=True)
        for f in sorted(os.listdir(opts.checkpoint)):
            src = os.path.join(opts.checkpoint, f)
            if os.path.isfile(src) and f.endswith(CHECKPOINT_FILES):
                shutil.copy2(src, os.path.join(ckpt_dst, f))
    params = engine_parameters(opts, model_path)
    params["grace_period_s"] = opts.grace_period_s
    with open(os.path.join(out, "config.pbtxt"), "w") as f:
        f.write(render_config(name, params))
    import torch
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
    }
    with open(os.path.join(out, MANIFEST_NAME), "w") as f:
        json.dump(manifest, f, indent=2)
    log(f"wrote {out} ({cfg.architecture}, backend '{BACKEND_NAME}') in {time.time() - t0:.1f}s")
    return out


def _version(pkg: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(pkg)
    except PackageNotFoundError:
        return None
