"""compressed-tensors FP8 (backend/models/ct_fp8.py), the worked example of a new weight
format (docs/development.md): checkpoints written by the compressed-tensors library in
llmcompressor's three FP8 presets give transformers' greedy tokens on the same
dequantized weights with the same activation rounding; variants the engine does not
run are refused naming the field."""

import copy
import json
import os

import pytest

from backend.models.config import UnsupportedModelError, load_model_config, model_config_from_dict
from backend.models.quant_linears import describe
from tests.conftest import random_prompts
from tests.helpers import quant_checkpoints as qc
from tests.helpers.checkpoints import make_checkpoint

PROMPTS = random_prompts(3, [1, 21, 9], seed=7)


@pytest.fixture(scope="module")
def base(ckpt_dir):
    return make_checkpoint(str(ckpt_dir / "llama-ct-fp8"), "llama")


def _agrees(path, ref):
    # As test_fp8_formats.py: one prompt may sit 1e-7 from an E4M3 rounding boundary.
    _, gaps = qc.assert_engine_matches(path, ref, PROMPTS, tol=0.05, device="cpu")
    assert min(gaps) < 1e-4, gaps


def test_dynamic_per_channel(base, tmp_path):
    path = qc.write_ct_fp8(base, str(tmp_path / "dynamic"), "FP8_DYNAMIC")
    assert describe(load_model_config(path).quantization) == "compressed-tensors FP8 dynamic"
    _agrees(path, qc.fp8_per_channel_reference(base, path))


def test_static_per_tensor(base, tmp_path):
    path = qc.write_ct_fp8(base, str(tmp_path / "static"), "FP8")
    assert describe(load_model_config(path).quantization) == "compressed-tensors FP8"
    _agrees(path, qc.fp8_per_channel_reference(base, path, qc.STATIC_INPUT_SCALE))


def test_block_wise(base, tmp_path):
    path = qc.write_ct_fp8(base, str(tmp_path / "block"), "FP8_BLOCK", (16, 32))
    assert describe(load_model_config(path).quantization) == "compressed-tensors FP8 block-wise dynamic"
    _agrees(path, qc.fp8_block_dequantized_reference(base, path, (16, 32)))


@pytest.mark.parametrize("change, field", [
    (lambda g: g["weights"].update(num_bits=4), "weights.num_bits"),
    (lambda g: g.update(input_activations=None), "input_activations is null"),
    (lambda g: g["input_activations"].update(strategy="tensor"), "input_activations.strategy"),
    (lambda g: g["weights"].update(strategy="group"), "weights.strategy"),
])
def test_variants_it_does_not_run_name_the_field(base, tmp_path, change, field):
    path = qc.write_ct_fp8(base, str(tmp_path / "dynamic"), "FP8_DYNAMIC")
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg = copy.deepcopy(cfg)
    change(cfg["quantization_config"]["config_groups"]["group_0"])
    with pytest.raises(UnsupportedModelError, match=field):
        model_config_from_dict(cfg)
