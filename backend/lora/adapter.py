"""A PEFT LoRA adapter folder (`adapter_config.json`, `adapter_model.safetensors`),
read and checked against the base model.

PEFT computes `base(x) + lora_B(lora_A(x)) * scaling` with scaling = lora_alpha / r (or
lora_alpha / sqrt(r) with use_rslora); each targeted Hugging Face projection has its own
A [r, in] and B [out, r]. The engine's q/k/v and gate/up are fused (backend/models/
loader.py), so every target is named here by its fused projection and its slice in it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file

from backend.config import ConfigError
from backend.models.config import ModelConfig

# Hugging Face projection -> (the engine's fused projection, slice index in it).
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
# A vision-language model's tower (its CLIP layers' names match _KEY too).
_TOWERS = ("vision_tower.", "visual.", "vision_model.", "multi_modal_projector.")
# adapter_config.json fields that change the math in ways this engine does not run.
_UNSUPPORTED = {"use_dora": "DoRA adapters", "modules_to_save": "modules_to_save (fully trained copies)",
                "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)",
                "fan_in_fan_out": "fan_in_fan_out (Conv1D) weights"}


class LoRAConfigError(ConfigError):
    """A bad adapter; the message names the adapter and the field."""


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each Hugging Face projection the model has."""
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    # (layer, Hugging Face projection) -> (A [r, in], B [out, r]), fp32 on the host.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    # SHA-256 of adapter_config.json and adapter_model.safetensors: the same files give the
    # same cache salt on every replica, other files under the same name another.
    content_hash: bytes = b""

    @property
    def target_modules(self) -> list[str]:
        return sorted({m for _, m in self.weights})


def shard_adapter(adapter: LoRAAdapter, cfg: ModelConfig, rank: int, size: int) -> LoRAAdapter:
    """This tensor-parallel rank's part of the adapter, split as the base weights are
    (backend/parallel/sharding.py): a column-parallel projection's B by output rows, a
    row-parallel one's A by input columns (its partial delta joins the layer's all-reduce)."""
    if size == 1:
        return adapter
    from backend.parallel.sharding import weight_slice
    parents = {"o_proj": "self_attn", "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn"}
    weights = {}
    for (layer, module), (a, b) in adapter.weights.items():
        dim, start, stop = weight_slice(f"model.layers.{layer}.{parents.get(module, 'mlp')}.{module}.weight", cfg,
                                        rank, size)
        weights[(layer, module)] = (a, b[start:stop]) if dim == 0 else (a[:, start:stop], b)
    return LoRAAdapter(adapter.name, adapter.path, adapter.rank, adapter.scaling, weights, adapter.content_hash)


def read_adapter_config(name: str, path: str) -> dict:
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise LoRAConfigError(f"LoRA adapter '{name}': no adapter_config.json in '{path}'")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except OSError as e:
        raise LoRAConfigError(f"LoRA adapter '{name}': cannot read adapter_config.json ({e.strerror})") from None
    except ValueError as e:
        raise LoRAConfigError(f"LoRA adapter '{name}': adapter_config.json is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise LoRAConfigError(f"LoRA adapter '{name}': adapter_config.json must hold an object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAConfigError(f"LoRA adapter '{name}': peft_type is {cfg.get('peft_type')!r}, only 'LORA' is served")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise LoRAConfigError(f"LoRA adapter '{name}': field '{key}' is set; {what} are not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAConfigError(f"LoRA adapter '{name}': field 'bias' is {cfg['bias']!r}; only 'none' is supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t.split(".")[-1] not in TARGETS]
        if unknown:
            raise LoRAConfigError(f"LoRA adapter '{name}': unknown target module '{unknown[0]}' in field "
                                  f"'target_modules' (supported: {', '.join(TARGETS)})")
    return cfg


def load_adapter(name: str, path: str, model: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """The adapter's weights, checked: rank within max_lora_rank, known targets, and
    shapes that fit this base model."""
    cfg = read_adapter_config(name, path)
    rank = cfg.get("r", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAConfigError(f"LoRA adapter '{name}': field 'r' must be a positive integer, not {rank!r}")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoRAConfigError(f"LoRA adapter '{name}': field 'lora_alpha' must be a number, not {alpha!r}")
    if rank > max_lora_rank:
        raise LoRAConfigError(f"LoRA adapter '{name}': field 'r' is {rank}, above max_lora_rank={max_lora_rank}")
    alpha = float(alpha)
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise LoRAConfigError(f"LoRA adapter '{name}': no adapter_model.safetensors in '{path}'")
    shapes = projection_shapes(model)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        tensors = load_file(file)
        digest = hashlib.sha256()
        for part in (os.path.join(path, "adapter_config.json"), file):
            with open(part, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
    except Exception as e:          # (safetensors raises its own error types)
        raise LoRAConfigError(f"LoRA adapter '{name}': adapter_model.safetensors cannot be read ({e})") from None
    for key, tensor in tensors.items():
        if any(tower in key for tower in _TOWERS):
            raise LoRAConfigError(f"LoRA adapter '{name}': weight '{key}' adapts the vision tower; adapters apply "
                                  "to the language model's projections only (field 'target_modules')")
        m = _KEY.search(key)
        module = m.group(2) if m else key
        if m is None or module not in TARGETS:
            raise LoRAConfigError(f"LoRA adapter '{name}': unknown target module in weight '{key}' "
                                  f"(field 'target_modules'; supported: {', '.join(TARGETS)})")
        layer = int(m.group(1))
        if layer >= model.num_layers:
            raise LoRAConfigError(f"LoRA adapter '{name}': base-model mismatch: weight '{key}' is for layer {layer}, "
                                  f"the model has {model.num_layers} layers")
        parts.setdefault((layer, module), {})[m.group(3)] = tensor.float()
    weights = {}
    for (layer, module), ab in sorted(parts.items()):
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None:
            raise LoRAConfigError(f"LoRA adapter '{name}': layer {layer} {module} has lora_{'B' if b is None else 'A'} "
                                  "without its pair")
        fan_in, fan_out = shapes[module]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoRAConfigError(
                f"LoRA adapter '{name}': base-model mismatch at layer {layer} {module}: lora_A {list(a.shape)}, "
                f"lora_B {list(b.shape)}; this model needs [{rank}, {fan_in}] and [{fan_out}, {rank}] (r={rank})")
        weights[(layer, module)] = (a, b)
    if not weights:
        raise LoRAConfigError(f"LoRA adapter '{name}': adapter_model.safetensors has no LoRA weights")
    return LoRAAdapter(name=name, path=path, rank=rank, scaling=scaling, weights=weights,
                       content_hash=digest.digest())
