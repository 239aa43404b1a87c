"""Adapter folders are checked at load; each error names the adapter and the field."""

import json
import os
import shutil

import pytest

from backend import LLM
from backend.config import ConfigError
from backend.lora.adapter import load_adapter
from backend.models.config import load_model_config
from tests.helpers.adapters import make_adapter
from tests.helpers.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def base(ckpt_dir):
    return make_checkpoint(str(ckpt_dir / "llama"), "llama")


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory):
    return make_adapter(base, str(tmp_path_factory.mktemp("lora") / "a"), rank=8, alpha=16, seed=1)


def edited(adapter, tmp_path, **fields):
    path = str(tmp_path / "edited")
    shutil.copytree(adapter, path)
    with open(os.path.join(path, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg.update(fields)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def test_reads_peft_folder(base, adapter):
    a = load_adapter("a", adapter, load_model_config(base), max_lora_rank=16)
    assert a.rank == 8 and a.scaling == 2.0
    assert a.target_modules == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert len(a.weights) == 2 * 7


@pytest.mark.parametrize("fields, message", [
    ({"r": 32}, r"LoRA adapter 'bad': field 'r' is 32, above max_lora_rank=16"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, r"LoRA adapter 'bad': unknown target module 'embed_tokens' "
                                                     r"in field 'target_modules'"),
    ({"use_dora": True}, r"LoRA adapter 'bad': field 'use_dora' is set"),
    ({"bias": "all"}, r"LoRA adapter 'bad': field 'bias' is 'all'"),
])
def test_bad_config_fails_the_load_naming_adapter_and_field(base, adapter, tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        LLM(base, block_size=4, num_kv_blocks=16, lora_modules={"good": adapter, "bad": edited(adapter, tmp_path,
                                                                                               **fields)})


def test_adapter_of_another_base_model_is_refused(base, ckpt_dir, tmp_path):
    other = make_checkpoint(str(tmp_path / "wide"), "llama", hidden_size=96)
    foreign = make_adapter(other, str(tmp_path / "foreign"), rank=4, targets=("q_proj",))
    with pytest.raises(ConfigError, match=r"LoRA adapter 'foreign': base-model mismatch at layer 0 q_proj: "
                                          r"lora_A \[4, 96\]"):
        LLM(base, block_size=4, num_kv_blocks=16, lora_modules={"foreign": foreign})


def test_engine_argument_checks():
    from backend.config import EngineArgs
    assert EngineArgs.create(model="m", lora_modules="a=/x b=/y").lora_modules == {"a": "/x", "b": "/y"}
    assert EngineArgs.create(model="m", lora_modules='[{"name": "a", "path": "/x"}]').enable_lora
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        EngineArgs.create(model="m", enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ConfigError, match="enable_lora needs model_runner='torch'"):
        EngineArgs.create(model="m", lora_modules="a=/x", model_runner="onnxruntime", model_graph="g.onnx")
