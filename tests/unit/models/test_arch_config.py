"""config.json of Gemma 2, Gemma 3 and Phi-3 as published (older transformers' field
names) and as transformers 5 writes them: the same ModelConfig."""

import math

import pytest

from backend.models.config import UnsupportedModelError, model_config_from_dict

BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def test_gemma2_published_config():
    """google/gemma-2-2b's fields: no layer_types (even layers slide), hidden_activation,
    caps, query_pre_attn_scalar, no tie_word_embeddings (tied by default)."""
    cfg = model_config_from_dict({**BASE, "architectures": ["Gemma2ForCausalLM"], "sliding_window": 4096,
                                  "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
                                  "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                                  "query_pre_attn_scalar": 256, "rope_theta": 10000.0})
    assert cfg.sliding_windows == (4096, None) * 3
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.query_pre_attn_scalar) == (50.0, 30.0, 256.0)
    assert cfg.tie_word_embeddings and cfg.hidden_act == "gelu_pytorch_tanh" and not cfg.qk_norm
    assert cfg.local_rope_theta is None


def test_gemma3_published_and_transformers5_configs_agree():
    old = model_config_from_dict({**BASE, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 512,
                                  "sliding_window_pattern": 3, "rope_theta": 1000000.0,
                                  "rope_local_base_freq": 10000.0,
                                  "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                  "attn_logit_softcapping": None, "final_logit_softcapping": None})
    new = model_config_from_dict({**BASE, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 512,
                                  "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
                                  "rope_parameters": {
                                      "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}})
    assert old == new
    assert old.sliding_windows == (512, 512, None) * 2
    assert old.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert (old.rope_theta, old.local_rope_theta) == (1e6, 10000.0)
    assert old.qk_norm and old.attn_logit_softcap is None and old.final_logit_softcap is None


def test_phi3_longrope_su_and_window():
    """Phi-3-mini-128k's fields: rope_scaling type 'su' (= longrope), the original
    context at the top level, factor from the two lengths, attention factor by the
    paper's formula; its sliding_window on every layer."""
    half = 8
    cfg = model_config_from_dict({**BASE, "architectures": ["Phi3ForCausalLM"], "sliding_window": 262144,
                                  "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                                  "rope_scaling": {"type": "su", "short_factor": [1.0] * half,
                                                   "long_factor": [2] * half}})
    assert cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096
    assert cfg.rope_scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert cfg.rope_scaling["long_factor"] == [2.0] * half
    assert cfg.sliding_windows == (262144,) * 6 and not cfg.tie_word_embeddings


@pytest.mark.parametrize("extra,needle", [
    ({"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.5625}, "partial_rotary_factor"),
    ({"architectures": ["Gemma3ForCausalLM"], "partial_rotary_factor": 0.5}, "q/k norms"),
    ({"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True}, "bidirectional"),
    ({"architectures": ["Gemma2ForCausalLM"], "layer_types": ["full_attention"]}, "layer_types"),
    ({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
])
def test_refused_with_the_field_named(extra, needle):
    with pytest.raises(UnsupportedModelError, match=needle):
        model_config_from_dict({**BASE, **extra})


def test_qwen2_window_only_from_max_window_layers_on():
    """transformers' Qwen2Config: the window needs use_sliding_window and applies from layer
    max_window_layers on (earlier this read every layer as sliding)."""
    base = {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32}
    assert model_config_from_dict({**base, "use_sliding_window": True, "max_window_layers": 4}).sliding_windows \
        == (None,) * 4 + (32,) * 2
    assert model_config_from_dict({**base, "use_sliding_window": False}).sliding_windows == (None,) * 6
    assert model_config_from_dict({**base, "use_sliding_window": False,
                                   "layer_types": ["sliding_attention"] * 6}).sliding_windows == (None,) * 6
