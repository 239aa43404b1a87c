"""W8A8 INT8 and FP8 (per-tensor, block-wise) checkpoints of the tiny test models as
their tools write them, and transformers reference models running the same numerics.

- W8A8: compressed-tensors `int-quantized` (its own writer, via builder/w8a8.py, which
  calls compressed-tensors' ModelCompressor as llmcompressor does). Reference: the
  weights compressed-tensors itself decompresses, and each projection's input rounded per
  token in a forward pre-hook (vLLM's dynamic per-token INT8: max|x| / 127, round half even).
- FP8 `quant_method: fp8`: written here following the layout vLLM's Fp8LinearMethod and
  transformers' FineGrainedFP8 read (`weight` float8_e4m3fn, `weight_scale` per tensor or
  `weight_scale_inv` per [block_n, block_k] block); no FP8 writer library is pinned.
  Block-wise reference: transformers' own FineGrainedFP8 loader with dequantize=True,
  activations rounded per token and group of block_k in a pre-hook (DeepSeek-V3's act_quant).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable, Optional

import torch
from safetensors.torch import load_file, save_file

from tests.helpers.checkpoints import logprob_gaps
from tests.helpers.int_checkpoints import PROJECTIONS

FP8_MAX = 448.0
STATIC_INPUT_SCALE = 4.0 / FP8_MAX          # what write_fp8(static=True) stores for every input


def _projection_names(state: dict) -> list[str]:
    return sorted({k.rsplit(".", 1)[0] for k in state if any(f".{p}." in k for p in PROJECTIONS)})


def with_input_hooks(model, fn: Callable[[torch.Tensor], torch.Tensor]):
    """Each decoder projection's input through fn (what the quantized GEMM sees)."""
    for name, mod in model.named_modules():
        if any(name.endswith(p) for p in PROJECTIONS):
            mod.register_forward_pre_hook(lambda m, args: (fn(args[0]),))
    return model


def per_token_int8(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 127.0
    return (torch.round(xf / s).clamp(-128, 127) * s).to(x.dtype)


def per_group_fp8(group: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        *lead, K = x.shape
        assert K % group == 0
        g = x.float().reshape(*lead, K // group, group)
        s = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        return ((g / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s).reshape(x.shape).to(x.dtype)
    return fn


def _load_into(base: str, state: dict[str, torch.Tensor]):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(m == "lm_head.weight" for m in missing), (missing, unexpected)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model


def w8a8_reference(base: str, path: str, round_inputs: bool = True):
    """transformers on compressed-tensors' own decompression of a W8A8 checkpoint (its
    smoothed norms included), inputs fake-quantized per token (unless round_inputs=False)."""
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    with open(os.path.join(path, "config.json")) as f:
        scheme = QuantizationScheme(**next(iter(json.load(f)["quantization_config"]["config_groups"].values())))
    state = load_file(os.path.join(path, "model.safetensors"))
    for name in _projection_names(state):
        local = {k[len(name) + 1:]: state.pop(k) for k in list(state) if k.startswith(name + ".")}
        state[f"{name}.weight"] = IntQuantizationCompressor.decompress(local, scheme)["weight"].float()
        if "bias" in local:
            state[f"{name}.bias"] = local["bias"]
    model = _load_into(base, state)
    return with_input_hooks(model, per_token_int8) if round_inputs else model


def w8a8_lora_reference(base: str, path: str, adapter: str):
    """PEFT's adapter over the W8A8 reference: only the base layers' inputs are rounded
    (the adapter's low-rank path takes the unrounded activations, as in the engine)."""
    from peft import PeftModel
    model = PeftModel.from_pretrained(w8a8_reference(base, path, round_inputs=False), adapter).eval()
    for name, mod in model.named_modules():
        wrapped = hasattr(mod, "base_layer")
        if not wrapped and any(name.endswith(p) or name.endswith(f"{p}.base_layer") for p in PROJECTIONS):
            mod.register_forward_pre_hook(lambda m, args: (per_token_int8(args[0]),))
    return model


def write_fp8(base: str, path: str, block: Optional[tuple[int, int]], static: bool = False) -> str:
    """A `quant_method: fp8` checkpoint: block-wise (weight_scale_inv per block, dynamic
    activations) or per-tensor (one weight_scale per projection; input_scale if static)."""
    os.makedirs(path, exist_ok=True)
    for f in os.listdir(base):
        if f != "model.safetensors" and os.path.isfile(os.path.join(base, f)):
            shutil.copy2(os.path.join(base, f), os.path.join(path, f))
    state = load_file(os.path.join(base, "model.safetensors"))
    for name in _projection_names(state):
        w = state[f"{name}.weight"].float()
        N, K = w.shape
        if block is None:
            s = w.abs().amax() / FP8_MAX
            state[f"{name}.weight"] = (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            state[f"{name}.weight_scale"] = s.reshape(())
            if static:
                state[f"{name}.input_scale"] = torch.tensor(STATIC_INPUT_SCALE)
            continue
        bn, bk = block
        gn, gk = -(-N // bn), -(-K // bk)
        padded = torch.zeros(gn * bn, gk * bk)
        padded[:N, :K] = w
        blocks = padded.reshape(gn, bn, gk, bk)
        s = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX            # [gn, gk]
        q = (blocks / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        state[f"{name}.weight"] = q.reshape(gn * bn, gk * bk)[:N, :K].contiguous()
        state[f"{name}.weight_scale_inv"] = s
    save_file(state, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "static" if static else "dynamic",
                                  **({"weight_block_size": list(block)} if block else {})}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return path


def fp8_block_reference(path: str, block_k: int):
    """transformers' own FineGrainedFP8 loading of a block-wise checkpoint, dequantized
    (its CPU path), inputs rounded per token and group of block_k through E4M3."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    return with_input_hooks(model, per_group_fp8(block_k))


def per_token_fp8(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return ((xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s).to(x.dtype)


def fp8_per_channel_reference(base: str, path: str, input_scale: Optional[float] = None):
    """transformers on a per-tensor / per-channel FP8 checkpoint's weights (weight *
    weight_scale), inputs rounded through E4M3 per token (dynamic) or with `input_scale`."""
    state = load_file(os.path.join(path, "model.safetensors"))
    for name in _projection_names(state):
        w, s = state.pop(f"{name}.weight"), state.pop(f"{name}.weight_scale")
        state.pop(f"{name}.input_scale", None)
        state[f"{name}.weight"] = w.float() * s.float().reshape(-1, 1)
    model = _load_into(base, state)
    if input_scale is None:
        return with_input_hooks(model, per_token_fp8)
    return with_input_hooks(model, lambda x: ((x.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(
        torch.float8_e4m3fn).float() * input_scale).to(x.dtype))


def assert_engine_matches(path: str, ref, prompts: list[list[int]], max_new: int = 8, tol: float = 1e-3,
                          lora_name: Optional[str] = None, logprobs: int = 2,
                          **llm_kw) -> tuple[list[list[int]], list[float]]:
    """The engine's greedy tokens equal the reference's, its logprobs within tol (fp32);
    the pool ends free. Returns (the tokens, each prompt's largest logprob gap)."""
    from backend import LLM, SamplingParams
    from tests.conftest import assert_pool_free
    llm = LLM(path, block_size=4, num_kv_blocks=64, max_num_batched_tokens=16, **llm_kw)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_new, min_tokens=max_new, temperature=0,
                                                logprobs=logprobs, lora_name=lora_name))
    gaps = logprob_gaps(ref, prompts, outs, max_new)
    assert max(gaps) < tol, gaps
    assert_pool_free(llm)
    return [o.token_ids for o in outs], gaps


def write_ct_fp8(base: str, path: str, preset: str, block: tuple[int, int] = (16, 32)) -> str:
    """A compressed-tensors `float-quantized` checkpoint written by the library itself
    (as llmcompressor saves one) in one of its FP8 presets: FP8_DYNAMIC (per-channel
    weights, per-token activations), FP8 (per-tensor weights, static input_scale
    STATIC_INPUT_SCALE) or FP8_BLOCK (`block` weight scales, per-group activations)."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from transformers import AutoModelForCausalLM

    from builder.int_quant import save_compressed
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if preset == "FP8_BLOCK":
        scheme.weights.block_structure = list(block)
        scheme.input_activations.group_size = block[1]
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for m in model.modules():
        if not hasattr(m, "weight_scale"):
            continue
        w = m.weight.data
        if preset == "FP8_BLOCK":
            (N, K), (bn, bk) = w.shape, block
            s = w.reshape(N // bn, bn, K // bk, bk).abs().amax(dim=(1, 3)) / FP8_MAX
        elif preset == "FP8":
            s = w.abs().amax() / FP8_MAX
            m.input_scale.data.copy_(torch.tensor(STATIC_INPUT_SCALE).reshape(m.input_scale.shape))
        else:
            s = w.abs().amax(-1, keepdim=True) / FP8_MAX
        m.weight_scale.data.copy_(s.reshape(m.weight_scale.shape))
    save_compressed(model, base, path, "float-quantized")
    return path


def fp8_block_dequantized_reference(base: str, path: str, block: tuple[int, int]):
    """transformers on a block-wise FP8 checkpoint's weights (weight times its block's
    `weight_scale`), inputs rounded through E4M3 per token and group of block_k."""
    state = load_file(os.path.join(path, "model.safetensors"))
    bn, bk = block
    for name in _projection_names(state):
        w, s = state.pop(f"{name}.weight"), state.pop(f"{name}.weight_scale")
        state[f"{name}.weight"] = w.float() * s.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    return with_input_hooks(_load_into(base, state), per_group_fp8(bk))
