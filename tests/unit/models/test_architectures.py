"""The architecture table: every entry names a model class that exists, and a config
reads as its family with config.json kept for the model class."""

import pytest

from backend.models.architectures import ARCHITECTURES
from backend.models.config import UnsupportedModelError, model_config_from_dict
from backend.models.llama import CausalLM
from backend.models.registry import model_class

# (The expert counts are read by the mixture-of-experts families only.)
BASE = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_entry_resolves_to_a_causal_lm(name):
    cfg = model_config_from_dict({**BASE, "architectures": [name]})
    assert cfg.family == ARCHITECTURES[name].family
    cls = model_class(cfg)
    assert issubclass(cls, CausalLM) and cls.__name__ == ARCHITECTURES[name].model_class
    assert cfg.hf_config["architectures"] == [name]


def test_an_unknown_architecture_names_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        model_config_from_dict({**BASE, "architectures": ["NoSuchForCausalLM"]})
