"""The weight-format registry: each quantization_config is read by exactly one format
(so their order cannot matter), and one that no format reads is refused naming the
supported formats."""

import pytest

from backend.models.config import UnsupportedModelError, model_config_from_dict
from backend.models.quant_linears import FORMATS, UnknownWeightFormat, describe, find_format

_W = {"type": "int", "num_bits": 8, "symmetric": True, "strategy": "channel"}
CONFIGS = {
    "paged_llm_fp8 FP8": {"quant_method": "paged_llm_fp8", "activation_scheme": "static"},
    "fp8 FP8 block-wise dynamic": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128]},
    "gptq INT4": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True},
    "awq INT4": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "compressed-tensors INT4": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32}}}},
    "compressed-tensors W8A8 INT8": {"quant_method": "compressed-tensors", "format": "int-quantized",
                                     "config_groups": {"group_0": {"weights": _W, "input_activations": {
                                         **_W, "strategy": "token", "dynamic": True}}}},
    "bitsandbytes INT4": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_config_is_read_by_exactly_one_format(name):
    quant = CONFIGS[name]
    readers = [type(fmt).__name__ for fmt in FORMATS if fmt.scheme_of(quant) is not None]
    assert len(readers) == 1, readers
    assert describe(quant) == name


def test_no_quantization_is_no_format():
    assert find_format(None) is None and describe({}) is None


@pytest.mark.parametrize("quant", [{"quant_method": "gguf"},
                                   {"quant_method": "compressed-tensors", "format": "marlin-24"}])
def test_a_config_no_format_reads_names_the_supported_ones(quant):
    with pytest.raises(UnknownWeightFormat, match="supported: .*gptq.*FP8"):
        find_format(quant)
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
           "num_hidden_layers": 1, "num_attention_heads": 2, "quantization_config": quant}
    with pytest.raises(UnsupportedModelError, match=f"unsupported quantization_config: quant_method "
                                                    f"'{quant['quant_method']}'"):
        model_config_from_dict(cfg)
