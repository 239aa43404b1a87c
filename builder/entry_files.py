"""What a build puts in the entry folder besides config.pbtxt and the manifest: the
checkpoint (copied, or rewritten with FP8 weights), a speculative draft and LoRA
adapters (copied, or pointed at with `link`), and the checkpoint hash the manifest
records."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from builder.build import BuildOptions

# (.jinja: transformers >= 5 writes the chat template to its own file, chat_template.jinja)
CHECKPOINT_FILES = (".json", ".safetensors", ".model", ".txt", ".tiktoken", ".jinja")


class BuildError(ValueError):
    pass


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


def copy_checkpoint(src: str, dst: str, extra: tuple[str, ...] = ()) -> None:
    """A checkpoint folder's files (config, weights, tokenizer) into dst; `extra`: more
    file endings to copy."""
    os.makedirs(dst, exist_ok=True)
    for f in sorted(os.listdir(src)):
        path = os.path.join(src, f)
        if os.path.isfile(path) and f.endswith(CHECKPOINT_FILES + extra):
            shutil.copy2(path, os.path.join(dst, f))


def write_fp8_checkpoint(src: str, dst: str, state: dict, qcfg: dict) -> None:
    """The source's files but its weights and config; `state` as the weights and
    `qcfg` as config.json's quantization_config."""
    from safetensors.torch import save_file
    os.makedirs(dst, exist_ok=True)
    for f in sorted(os.listdir(src)):
        full = os.path.join(src, f)
        if os.path.isfile(full) and f.endswith(CHECKPOINT_FILES) and f != "config.json" \
                and not f.endswith(".safetensors") and f != "model.safetensors.index.json":
            shutil.copy2(full, os.path.join(dst, f))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qcfg
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(dst, "model.safetensors"))


def place_draft(opts: BuildOptions, out: str) -> Optional[str]:
    """The drafter's checkpoint (a draft model, EAGLE or Medusa heads) in the entry (its
    path relative to the entry), or its absolute path with `link`; None without one. A
    draft model's tokenizer is checked at load."""
    spec = opts.speculative
    if spec is None or spec.method == "ngram":
        return None
    if not os.path.isfile(os.path.join(spec.model, "config.json")):
        raise BuildError(f"invalid build option 'speculative.model': no checkpoint (config.json) in '{spec.model}'")
    if opts.link:
        return os.path.abspath(spec.model)
    # EAGLE and Medusa heads are often published as pytorch_model.bin or .pt (their loaders read both).
    copy_checkpoint(spec.model, os.path.join(out, "draft"), (".bin", ".pt") if spec.method != "draft_model" else ())
    return "draft"


def place_adapters(opts: BuildOptions, cfg, out: str) -> dict[str, str]:
    """Each LoRA adapter, checked against the model as the engine will check it, in the
    entry (`loras/<name>`, relative) or at its absolute path with `link`."""
    from backend.lora.adapter import LoRAConfigError, load_adapter
    placed = {}
    for name, path in opts.lora_modules.items():
        try:
            load_adapter(name, path, cfg, opts.max_lora_rank)
        except LoRAConfigError as e:
            raise BuildError(f"invalid build option 'lora_modules': {e}") from None
        if opts.link:
            placed[name] = os.path.abspath(path)
            continue
        dst = os.path.join(out, "loras", name)
        os.makedirs(dst, exist_ok=True)
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copy2(os.path.join(path, f), os.path.join(dst, f))
        placed[name] = os.path.join("loras", name)
    return placed
