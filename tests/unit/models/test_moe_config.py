"""MoE facts read from config.json: which layers are sparse (Hugging Face's
decoder_sparse_step / mlp_only_layers rule), the expert counts under either key, the
checkpoint names per family; tensor-parallel checks; quantized MoE refused."""

import pytest

from backend.models.config import UnsupportedModelError, model_config_from_dict
from backend.parallel.moe_sharding import with_expert_parallel
from backend.parallel.sharding import check_tensor_parallel, local_config

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2)


def qwen(arch="Qwen3MoeForCausalLM", **kw):
    return model_config_from_dict({**BASE, "architectures": [arch], "num_experts_per_tok": 2,
                                   "moe_intermediate_size": 24, **kw})


def test_sparse_layers_follow_step_and_mlp_only_layers():
    cfg = qwen(num_experts=8, decoder_sparse_step=2, mlp_only_layers=[3])
    # (i + 1) % 2 == 0 -> layers 1, 3, 5; layer 3 is dense by mlp_only_layers.
    assert cfg.moe.sparse_layers == (False, True, False, False, False, True)
    assert cfg.qk_norm and not cfg.qkv_bias


def test_expert_count_keys_and_families():
    assert qwen(num_local_experts=6).moe.num_experts == 6       # what transformers 5 writes
    q2 = qwen("Qwen2MoeForCausalLM", num_experts=4, shared_expert_intermediate_size=40)
    assert q2.moe.shared_expert_intermediate_size == 40 and q2.qkv_bias and not q2.moe.norm_topk_prob
    # Qwen3-MoE has no shared expert, whatever its config.json holds.
    assert qwen(num_experts=4, shared_expert_intermediate_size=40).moe.shared_expert_intermediate_size == 0
    mixtral = model_config_from_dict({**BASE, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
                                      "num_experts_per_tok": 2, "sliding_window": 16})
    moe = mixtral.moe
    assert moe.norm_topk_prob and moe.intermediate_size == 48 and all(moe.sparse_layers)
    assert moe.checkpoint_block == "block_sparse_moe" and moe.checkpoint_projections == ("w1", "w3", "w2")
    assert mixtral.sliding_windows == (16,) * 6


def test_tensor_parallel_checks_and_local_shapes():
    cfg = qwen(num_experts=6, moe_intermediate_size=18)
    assert check_tensor_parallel(cfg, 4) == "moe_intermediate_size 18 does not divide over 4 ranks"
    ep = with_expert_parallel(cfg, True)
    assert check_tensor_parallel(ep, 4) == "6 experts do not divide over 4 ranks (enable_expert_parallel)"
    assert check_tensor_parallel(ep, 2) is None
    sliced, whole = local_config(cfg, 2).moe, local_config(ep, 2).moe
    assert (sliced.num_local_experts, sliced.intermediate_size) == (6, 9)
    assert (whole.num_local_experts, whole.num_experts, whole.intermediate_size) == (3, 6, 18)


def test_quantized_moe_checkpoint_is_refused_but_our_fp8_builds():
    # Our FP8 builds load (backend/models/moe_fp8.py); other formats' MoE layouts do not.
    assert qwen(num_experts=4, quantization_config={"quant_method": "paged_llm_fp8"}).moe is not None
    with pytest.raises(UnsupportedModelError, match="quantized mixture-of-experts .* --weights fp8"):
        qwen(num_experts=4, quantization_config={"quant_method": "fp8"})
