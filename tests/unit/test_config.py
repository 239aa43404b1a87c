import json

import pytest

from backend import LLM, ConfigError, EngineArgs
from backend.models.config import UnsupportedModelError, load_model_config


def test_bad_engine_args_name_the_field():
    with pytest.raises(ConfigError, match="'block_size'"):
        EngineArgs.create(model="x", block_size=0)
    with pytest.raises(ConfigError, match="unknown engine argument 'blok_size'"):
        EngineArgs.create(model="x", blok_size=16)
    with pytest.raises(ConfigError, match="'dtype'"):
        EngineArgs.create(model="x", dtype="float64")


def test_max_model_len_must_fit_pool(llama_ckpt):
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(llama_ckpt, block_size=4, num_kv_blocks=10, max_model_len=100)
    llm = LLM(llama_ckpt, block_size=4, num_kv_blocks=10)
    assert llm.kv_cache_stats()["max_model_len"] == 40


def test_pool_sized_from_memory_budget(llama_ckpt):
    # 2 layers x 2 kv heads x 16 dims x 2 (K,V) x 4 bytes = 512 bytes/token; 16-token blocks.
    llm = LLM(llama_ckpt, block_size=16, kv_cache_memory_bytes=512 * 16 * 30)
    assert llm.kv_cache_stats()["num_total_blocks"] == 30


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model_config(str(tmp_path))
    with pytest.raises(UnsupportedModelError, match="no config.json"):
        load_model_config(str(tmp_path / "nowhere"))
