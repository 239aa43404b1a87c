"""Weight loading fuses q/k/v into qkv_proj and gate/up into gate_up_proj: bf16 weights
and biases concatenate; FP8 checkpoints keep their bytes, concatenate their per-channel
scales and merge their input scales; the fused FP8 linear computes what the three
separate ones did."""

import torch

from backend.models.fp8 import FP8Linear, quantize_per_channel
from backend.models.loader import fuse_projections


def layer_state(fp8: bool, g: torch.Generator) -> dict:
    state = {}
    for name, out in (("q_proj", 8), ("k_proj", 4), ("v_proj", 4)):
        w = torch.randn(out, 6, generator=g)
        key = f"model.layers.0.self_attn.{name}"
        if fp8:
            state[f"{key}.weight"], state[f"{key}.weight_scale"] = quantize_per_channel(w)
            state[f"{key}.input_scale"] = torch.tensor(0.01 * (1 + out))
        else:
            state[f"{key}.weight"], state[f"{key}.bias"] = w, torch.randn(out, generator=g)
    for name in ("gate_proj", "up_proj"):
        state[f"model.layers.0.mlp.{name}.weight"] = torch.randn(10, 6, generator=g)
    return state


def test_bf16_projections_concatenate_in_order():
    g = torch.Generator().manual_seed(0)
    state = layer_state(False, g)
    parts = [state[f"model.layers.0.self_attn.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj")]
    gate, up = state["model.layers.0.mlp.gate_proj.weight"], state["model.layers.0.mlp.up_proj.weight"]
    fused = fuse_projections(state, 1)
    assert torch.equal(fused["model.layers.0.self_attn.qkv_proj.weight"], torch.cat(parts))
    assert fused["model.layers.0.self_attn.qkv_proj.bias"].shape == (16,)
    assert torch.equal(fused["model.layers.0.mlp.gate_up_proj.weight"], torch.cat([gate, up]))
    assert not any(k.endswith(("q_proj.weight", "gate_proj.weight")) for k in fused)


def test_fp8_fused_linear_equals_the_separate_ones():
    g = torch.Generator().manual_seed(1)
    state = layer_state(True, g)
    x = torch.randn(3, 6, generator=g)
    merged_scale = max(float(state[f"model.layers.0.self_attn.{n}.input_scale"]) for n in ("q_proj", "k_proj", "v_proj"))
    separate = []
    for name in ("q_proj", "k_proj", "v_proj"):
        key = f"model.layers.0.self_attn.{name}"
        lin = FP8Linear(6, state[f"{key}.weight"].shape[0], bias=False)
        lin.load_state_dict({"weight": state[f"{key}.weight"], "weight_scale": state[f"{key}.weight_scale"],
                             "input_scale": torch.tensor(merged_scale)}, assign=True)
        separate.append(lin(x))
    fused = fuse_projections(state, 1)
    key = "model.layers.0.self_attn.qkv_proj"
    assert fused[f"{key}.weight"].dtype == torch.float8_e4m3fn
    assert float(fused[f"{key}.input_scale"]) == merged_scale
    lin = FP8Linear(6, 16, bias=False)
    lin.load_state_dict({"weight": fused[f"{key}.weight"], "weight_scale": fused[f"{key}.weight_scale"],
                         "input_scale": fused[f"{key}.input_scale"]}, assign=True)
    # One GEMM of 16 columns against three narrower ones: equal up to the order a BLAS
    # sums in (bit-equal on the 2-core CI machine; a 16-core host's kernels differ).
    torch.testing.assert_close(lin(x), torch.cat(separate, dim=1), rtol=1e-6, atol=1e-6)
