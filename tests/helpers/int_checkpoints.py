"""Weight-only INT4/INT8 checkpoints of the tiny test models, in the three formats the
engine reads, and each format's reference dequantization.

- compressed-tensors: written by compressed-tensors itself (its quantization config,
  qparams and ModelCompressor, as llmcompressor does); reference: its own
  PackedQuantizationCompressor.decompress.
- GPTQ and AWQ: their libraries do not install here (CUDA builds), so the packers follow
  their published layouts (AutoGPTQ's QuantLinear.pack, AutoAWQ's WQLinear_GEMM), and the
  references transcribe their torch dequantization (AutoGPTQ's QuantLinear forward,
  AutoAWQ's packing_utils.dequantize_gemm), in float32.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def _copy_base(base: str, path: str) -> dict[str, torch.Tensor]:
    os.makedirs(path, exist_ok=True)
    for f in os.listdir(base):
        if f != "model.safetensors" and os.path.isfile(os.path.join(base, f)):
            shutil.copy2(os.path.join(base, f), os.path.join(path, f))
    return load_file(os.path.join(base, "model.safetensors"))


def _set_quant_config(path: str, quant: dict) -> None:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quant
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def _names(state: dict) -> list[str]:
    return sorted(k[:-len(".weight")] for k in state if k.endswith(".weight") and k.split(".")[-2] in
                  {p.split(".")[1] for p in PROJECTIONS} and ".layers." in k)


# ---------------------------------------------------------------- compressed-tensors
def write_compressed_tensors(base: str, path: str, bits: int, group_size: int, symmetric: bool) -> str:
    """group_size -1: channel strategy."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    strategy = "channel" if group_size == -1 else "group"
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=None if group_size == -1 else group_size)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"]))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.data
            g = w.shape[1] if group_size == -1 else group_size
            wg = w.reshape(w.shape[0], -1, g)
            scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            module.weight_zero_point.data.copy_(zp.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    return path


def compressed_tensors_reference(path: str) -> dict[str, torch.Tensor]:
    """name -> float weight [N, K], by compressed-tensors' own decompression."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    with open(os.path.join(path, "config.json")) as f:
        group = next(iter(json.load(f)["quantization_config"]["config_groups"].values()))
    scheme = QuantizationScheme(**group)
    state = load_file(os.path.join(path, "model.safetensors"))
    out = {}
    for key in state:
        if key.endswith(".weight_packed"):
            name = key[:-len(".weight_packed")]
            local = {k[len(name) + 1:]: v for k, v in state.items() if k.startswith(name + ".")}
            out[name] = PackedQuantizationCompressor.decompress(local, scheme)["weight"].float()
    return out


# ------------------------------------------------------------------------ GPTQ
def _rtn(w_rows: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w_rows [k, N] of one group -> (unsigned q [k, N], scale [N], zero [N] unsigned)."""
    top = (1 << bits) - 1
    if symmetric:
        scale = (w_rows.abs().amax(0) / ((top + 1) // 2 - 1)).clamp(min=1e-8).half().float()
        zero = torch.full_like(scale, (top + 1) // 2)
    else:
        lo, hi = w_rows.amin(0).clamp(max=0), w_rows.amax(0).clamp(min=0)
        scale = ((hi - lo) / top).clamp(min=1e-8).half().float()
        zero = torch.round(-lo / scale).clamp(0, top)
    q = torch.clamp(torch.round(w_rows / scale) + zero, 0, top)
    return q.to(torch.int32), scale, zero.to(torch.int32)


def _pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[K, N] -> [K*bits/32, N], AutoGPTQ's qweight: row j of a word at bits*j."""
    per = 32 // bits
    out = torch.zeros(q.shape[0] // per, q.shape[1], dtype=torch.int64)
    for j in range(per):
        out |= q[j::per].to(torch.int64) << (bits * j)
    return out.to(torch.int32)


def _pack_cols(q: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """[R, N] -> [R, N*bits/32]; word c holds columns c*per + order[i] at bits*i."""
    per = 32 // bits
    order = order or list(range(per))
    out = torch.zeros(q.shape[0], q.shape[1] // per, dtype=torch.int64)
    for i in range(per):
        out |= q[:, order[i]::per].to(torch.int64) << (bits * i)
    return out.to(torch.int32)


def write_gptq(base: str, path: str, bits: int, group_size: int, desc_act: bool, seed: int = 0) -> str:
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    state = _copy_base(base, path)
    gen = torch.Generator().manual_seed(seed)
    for name in _names(state):
        w = state.pop(f"{name}.weight").float().t()                     # [K, N]
        K, N = w.shape
        perm = torch.randperm(K, generator=gen) if desc_act else torch.arange(K)
        g_idx = torch.empty(K, dtype=torch.int32)
        g_idx[perm] = (torch.arange(K) // group_size).to(torch.int32)  # act order: groups over permuted rows
        G = K // group_size
        q = torch.zeros(K, N, dtype=torch.int32)
        scales, zeros = torch.zeros(G, N), torch.zeros(G, N, dtype=torch.int32)
        for g in range(G):
            rows = (g_idx == g).nonzero().flatten()
            q[rows], scales[g], zeros[g] = _rtn(w[rows], bits, symmetric=not desc_act)
        state[f"{name}.qweight"] = _pack_rows(q, bits)
        state[f"{name}.qzeros"] = _pack_cols((zeros - 1) & ((1 << bits) - 1), bits)      # v1: zero - 1
        state[f"{name}.scales"] = scales.half()
        state[f"{name}.g_idx"] = g_idx
    save_file(state, os.path.join(path, "model.safetensors"))
    _set_quant_config(path, {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act,
                             "sym": not desc_act, "checkpoint_format": "gptq"})
    return path


def gptq_reference(qweight, qzeros, scales, g_idx, bits) -> torch.Tensor:
    """AutoGPTQ's torch dequantization (QuantLinear), float32; returns [N, K]."""
    wf = torch.tensor(list(range(0, 32, bits)), dtype=torch.int32).unsqueeze(0)
    zeros = torch.bitwise_right_shift(torch.unsqueeze(qzeros, 2).expand(-1, -1, 32 // bits),
                                      wf.unsqueeze(0)).to(torch.int16 if bits == 8 else torch.int8)
    zeros = zeros + 1
    zeros = torch.bitwise_and(zeros, (2 ** bits) - 1)
    zeros = zeros.reshape(scales.shape)
    weight = torch.bitwise_right_shift(torch.unsqueeze(qweight, 1).expand(-1, 32 // bits, -1),
                                       wf.unsqueeze(-1)).to(torch.int16 if bits == 8 else torch.int8)
    weight = torch.bitwise_and(weight, (2 ** bits) - 1)
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    g = g_idx.long()
    return (scales.float()[g] * (weight.float() - zeros.float()[g])).t()


# ------------------------------------------------------------------------- AWQ
def write_awq(base: str, path: str, group_size: int) -> str:
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    state = _copy_base(base, path)
    for name in _names(state):
        w = state.pop(f"{name}.weight").float().t()                     # [K, N]
        K, N = w.shape
        G = K // group_size
        q = torch.zeros(K, N, dtype=torch.int32)
        scales, zeros = torch.zeros(G, N), torch.zeros(G, N, dtype=torch.int32)
        for g in range(G):
            rows = slice(g * group_size, (g + 1) * group_size)
            q[rows], scales[g], zeros[g] = _rtn(w[rows], 4, symmetric=False)
        state[f"{name}.qweight"] = _pack_cols(q, 4, AWQ_ORDER)
        state[f"{name}.qzeros"] = _pack_cols(zeros, 4, AWQ_ORDER)
        state[f"{name}.scales"] = scales.half()
    save_file(state, os.path.join(path, "model.safetensors"))
    _set_quant_config(path, {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                             "version": "gemm"})
    return path


def awq_reference(qweight, qzeros, scales, bits: int, group_size: int) -> torch.Tensor:
    """AutoAWQ's packing_utils.dequantize_gemm, float32; returns [N, K]."""
    shifts = torch.arange(0, 32, bits)
    iweights = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(torch.int8)
    iweights = iweights.view(iweights.shape[0], -1)
    izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(torch.int8)
    izeros = izeros.view(izeros.shape[0], -1)
    reverse = torch.arange(iweights.shape[-1], dtype=torch.int32).view(-1, 32 // bits)[:, AWQ_REVERSE_ORDER]
    reverse = reverse.view(-1)
    izeros, iweights = izeros[:, reverse], iweights[:, reverse]
    iweights = torch.bitwise_and(iweights, (2 ** bits) - 1)
    izeros = torch.bitwise_and(izeros, (2 ** bits) - 1)
    s = scales.float().repeat_interleave(group_size, dim=0)
    z = izeros.repeat_interleave(group_size, dim=0)
    return ((iweights - z).float() * s).t()


def reference_weights(path: str) -> dict[str, torch.Tensor]:
    """name -> the format's reference dequantization [N, K] (float32)."""
    with open(os.path.join(path, "config.json")) as f:
        quant = json.load(f)["quantization_config"]
    if quant["quant_method"] == "compressed-tensors":
        return compressed_tensors_reference(path)
    state = load_file(os.path.join(path, "model.safetensors"))
    names = sorted(k[:-len(".qweight")] for k in state if k.endswith(".qweight"))
    if quant["quant_method"] == "gptq":
        return {n: gptq_reference(state[f"{n}.qweight"], state[f"{n}.qzeros"], state[f"{n}.scales"],
                                  state[f"{n}.g_idx"], quant["bits"]) for n in names}
    return {n: awq_reference(state[f"{n}.qweight"], state[f"{n}.qzeros"], state[f"{n}.scales"], 4,
                             quant["group_size"]) for n in names}


def reference_model(base: str, path: str):
    """transformers' model of `base` with the quantized checkpoint's reference weights."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in reference_weights(path).items():
            params[f"{name}.weight"].copy_(w)
    return model
