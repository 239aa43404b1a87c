"""`builder build --weights fp8` of mixture-of-experts checkpoints: FP8 experts with
per-expert, per-channel scales (weight-only), FP8Linear attention and dense MLPs, the
router and shared expert in the source dtype; the experts stay FP8 in the engine. The
engine's greedy tokens equal
transformers' on the same dequantized weights with the same activation rounding."""

import os

import pytest
import torch
from safetensors.torch import load_file

from backend.models.config import load_model_config
from backend.models.fp8 import fake_quantize
from backend.models.moe_fp8 import SCALE_SUFFIX
from backend.ops.fp8_quant import dequantize_experts
from builder.build import BuildError, BuildOptions, build
from tests.conftest import random_prompts
from tests.helpers import quant_checkpoints as qc
from tests.helpers.moe_checkpoints import make_moe_checkpoint

PROMPTS = random_prompts(3, [1, 21, 9], seed=3)


def fp8_moe_reference(base: str, path: str):
    """transformers on the built checkpoint's weights dequantized (weight * scale), each FP8
    linear's input rounded through E4M3 with its static input scale, experts unrounded."""
    from transformers import AutoModelForCausalLM
    state = load_file(os.path.join(path, "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    modules = dict(model.named_modules())
    weights = {}
    for k, v in state.items():
        if k.endswith(SCALE_SUFFIX) or k.endswith((".weight_scale", ".input_scale")):
            continue
        if k.endswith(".weight") and k[:-7] + ".weight_scale" in state:
            weights[k] = v.float() * state[k[:-7] + ".weight_scale"][:, None]
            scale = state[k[:-7] + ".input_scale"]
            modules[k[:-7]].register_forward_pre_hook(lambda m, a, s=scale: (fake_quantize(a[0], s),))
        elif k + SCALE_SUFFIX in state:
            weights[k] = dequantize_experts(v, state[k + SCALE_SUFFIX])
        else:
            weights[k] = v.float()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all(m == "lm_head.weight" for m in missing), (missing, unexpected)
    return model


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_fp8_moe_build_equals_transformers_on_dequantized_weights(ckpt_dir, tmp_path, arch):
    base = make_moe_checkpoint(str(ckpt_dir / arch), arch)
    out = build(BuildOptions.create(checkpoint=base, output=str(tmp_path / arch), weights="fp8", num_kv_blocks=64,
                                    block_size=8), log=lambda *_: None, progress=False)
    path = os.path.join(out, "checkpoint")
    state = load_file(os.path.join(path, "model.safetensors"))
    gate_up = state["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.dtype == torch.float8_e4m3fn and state["model.layers.0.mlp.experts.down_proj"].dtype == gate_up.dtype
    assert state["model.layers.0.mlp.experts.gate_up_proj" + SCALE_SUFFIX].shape == gate_up.shape[:2]
    assert state["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert state["model.layers.0.mlp.gate.weight"].dtype == torch.float32           # the router
    if arch == "qwen2_moe":
        assert state["model.layers.0.mlp.shared_expert.gate_proj.weight"].dtype == torch.float32
    if arch == "qwen3_moe":                                 # its dense layer (mlp_only_layers) is FP8Linear
        assert state["model.layers.1.mlp.gate_proj.weight"].dtype == torch.float8_e4m3fn
    # Activation rounding is discontinuous (see test_fp8_formats._agrees): one prompt may
    # land an input on the other E4M3 neighbour; the others agree to 1e-4. On CPU: an H100's
    # FP8 GEMMs accumulate with fewer bits than fp32 (tokens and gaps differed there).
    tokens, gaps = qc.assert_engine_matches(path, fp8_moe_reference(base, path), PROMPTS, tol=0.05, device="cpu")
    assert min(gaps) < 1e-4, gaps
    if arch == "qwen2_moe":
        # The fused MoE Triton kernel (interpreter) dequantizing the FP8 tiles: the same tokens.
        from backend import LLM, SamplingParams
        llm = LLM(path, block_size=4, num_kv_blocks=64, attention_backend="triton")
        assert llm.generate(PROMPTS[1:2], SamplingParams(max_tokens=4, temperature=0))[0].token_ids == tokens[1][:4]
    if arch == "qwen2_moe":
        # bf16 serving: the experts stay FP8 with fp32 scales (dequantized per call on CPU),
        # the shared expert bf16: the planner's FP8 bytes follow (within the input scales
        # and the fp32 q/k/v biases of the FP8 linears, which it does not count).
        from backend import LLM, SamplingParams
        from builder import plan
        from tests.conftest import assert_pool_free
        llm = LLM(path, dtype="bfloat16", block_size=4, num_kv_blocks=32)
        experts = llm.engine.model.model.layers[0].mlp.experts
        assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float8_e4m3fn
        assert experts.gate_up_proj_scale.dtype == torch.float32
        engine_bytes = llm.engine.bytes_per_rank[0][0]
        assert abs(plan.weight_bytes(load_model_config(path), "fp8") - engine_bytes) < 0.01 * engine_bytes
        out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, min_tokens=3, temperature=0))
        assert len(out[0].token_ids) == 3
        assert_pool_free(llm)
    if arch == "mixtral":
        with pytest.raises(BuildError, match="'tensor_parallel_size': 2 \\(FP8 mixture-of-experts builds run on "
                                             "one rank\\)"):
            build(BuildOptions.create(checkpoint=base, output=str(tmp_path / "tp"), weights="fp8",
                                      tensor_parallel_size=2), log=lambda *_: None, progress=False)
