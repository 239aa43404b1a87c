"""Random-weight mixture-of-experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss)
small enough for CI, with the features each family has switched on."""

from __future__ import annotations

import os

import torch

from tests.helpers.checkpoints import COMMON

MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")

# top-k > 1 everywhere; Mixtral with a window shorter than the longer prompts; Qwen2-MoE
# with its shared expert; Qwen3-MoE renormalizing, with a dense layer among the sparse
# ones (mlp_only_layers).
OVERRIDES = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96, sliding_window=48),
    "qwen2_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=80, norm_topk_prob=False),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, head_dim=32,
                      norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1], decoder_sparse_step=1),
    # gpt-oss: sliding (window 12 < prompts) then full layer, YaRN over a 64-token original
    # context, a SwiGLU limit that binds at these activations' scale.
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=16,
                    max_position_embeddings=512,
                    sliding_window=12, layer_types=["sliding_attention", "full_attention"], swiglu_limit=2.0,
                    rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 64,
                                     "rope_theta": 150000.0}),
}


def make_moe_checkpoint(path: str, arch: str, seed: int = 0, **overrides) -> str:
    import transformers as tf
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    kw = {**COMMON, **OVERRIDES[arch], **overrides}
    classes = {"mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
               "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
               "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
               "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM)}
    cfg_cls, cls = classes[arch]
    torch.manual_seed(seed)
    model = cls(cfg_cls(**kw)).eval()
    if arch == "qwen2_moe":
        # Random init leaves the q/k/v biases at zero; make them matter.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if arch == "gpt_oss":
        # Sinks, biases and the router bias start at (or near) zero: make them matter.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("sinks"):
                    p.normal_(0, 2.0)
                elif name.endswith("bias"):
                    p.normal_(0, 0.5)
    model.save_pretrained(path)
    return path
