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
    with pytest.raises(ConfigError, match="invalid engine argument 'max_logprobs'"):
        EngineArgs.create(model="x", max_logprobs=-1)


def test_max_model_len_must_fit_pool(llama_ckpt):
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(llama_ckpt, block_size=4, num_kv_blocks=10, max_model_len=100)
    llm = LLM(llama_ckpt, block_size=4, num_kv_blocks=10)
    assert llm.stats()["max_model_len"] == 40


def test_pool_sized_from_memory_budget(llama_ckpt):
    # 2 layers x 2 kv heads x 16 dims x 2 (K,V) x 4 bytes = 512 bytes/token; 16-token blocks.
    llm = LLM(llama_ckpt, block_size=16, kv_cache_memory_bytes=512 * 16 * 30)
    assert llm.stats()["num_total_blocks"] == 30


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model_config(str(tmp_path))
    with pytest.raises(UnsupportedModelError, match="no config.json"):
        load_model_config(str(tmp_path / "nowhere"))


def test_speculative_config_is_validated_and_names_the_field():
    ok = EngineArgs.create(model="m", speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    spec = ok.speculative_config
    assert spec.method == "ngram" and (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)  # vLLM's
    spec = EngineArgs.create(model="m", speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                            "prompt_lookup_max": 3}).speculative_config
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (3, 3)
    # vLLM's shorthand: the method follows from `model`.
    assert EngineArgs.create(model="m", speculative_config={"model": "d", "num_speculative_tokens": 2}
                             ).speculative_config.method == "draft_model"
    bad = [
        ('{"method": "mtp", "num_speculative_tokens": 3}', "speculative_config.method"),
        ('{"method": "medusa", "num_speculative_tokens": 3}', "method 'medusa' needs 'model'"),
        ('{"method": "eagle3", "num_speculative_tokens": 3}', "method 'eagle3' needs 'model'"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "speculative_config.num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
         "prompt_lookup_min"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs 'model'"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}', "speculative_config.k"),
        ("{not json", "speculative_config.*not valid JSON"),
    ]
    for value, match in bad:
        with pytest.raises(ConfigError, match=match):
            EngineArgs.create(model="m", speculative_config=value)
    with pytest.raises(ConfigError, match="model_runner='torch'"):
        EngineArgs.create(model="m", model_runner="onnxruntime", model_graph="g.onnx",
                          speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="tensor_parallel_size=1"):
        EngineArgs.create(model="m", tensor_parallel_size=2,
                          speculative_config={"method": "draft_model", "model": "d", "num_speculative_tokens": 2})


def test_a_check_across_fields_names_them_not_root():
    from backend.sampling_params import SamplingParams, SamplingParamsError
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams.create(min_tokens=5, max_tokens=3)
    assert str(e.value) == "invalid sampling parameters: min_tokens (5) must be <= max_tokens (3)"


def test_seed_is_an_int64():
    from backend.sampling_params import SamplingParams, SamplingParamsError
    assert SamplingParams.create(seed=2**63 - 1).seed == 2**63 - 1
    for bad in (2**63, -2**63 - 1):
        with pytest.raises(SamplingParamsError, match="invalid sampling parameter 'seed'"):
            SamplingParams.create(seed=bad)
