import json

import pytest

from backend.config import ConfigError
from backend.triton_server.serving_config import load_settings
from backend.triton_server.vllm_model_json import read_model_json


def write(model_dir, obj):
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "1" / "model.json").write_text(json.dumps(obj) if not isinstance(obj, str) else obj)


def test_vllm_sample_maps_onto_engine_args(tmp_path, tiny_ckpt):
    write(tmp_path, {"model": tiny_ckpt, "gpu_memory_utilization": 0.1, "enforce_eager": True, "dtype": "half",
                     "num_gpu_blocks_override": 64, "tensor_parallel_size": 1, "disable_log_requests": True,
                     "trust_remote_code": False, "kv_cache_dtype": "fp8_e4m3"})
    params, warnings = read_model_json(str(tmp_path))
    assert params == {"model": tiny_ckpt, "gpu_memory_utilization": "0.1", "enforce_eager": "true",
                      "dtype": "float16", "num_kv_blocks": "64", "kv_cache_dtype": "fp8",
                      "tensor_parallel_size": "1"}
    assert warnings == ["model.json key 'disable_log_requests' has no effect with this backend; ignored",
                        "model.json key 'trust_remote_code' has no effect with this backend; ignored"]
    args, _ = load_settings(params, str(tmp_path))
    assert (args.gpu_memory_utilization, args.enforce_eager, args.num_kv_blocks) == (0.1, True, 64)


def test_no_file_is_nothing(tmp_path):
    assert read_model_json(str(tmp_path)) == ({}, [])


@pytest.mark.parametrize("obj,expected", [
    ({"quantization": "bitsandbytes"}, "'quantization'"),
    ({"quantization": "fp8", "model": "."}, "says None; make one with"),
    ("{not json", "not valid JSON"),
    ([1, 2], "JSON object"),
])
def test_bad_values_name_the_key(tmp_path, obj, expected):
    write(tmp_path, obj)
    with pytest.raises(ConfigError, match=expected):
        read_model_json(str(tmp_path))


def test_tensor_parallel_size_carries_over(tmp_path, tiny_ckpt):
    write(tmp_path, {"model": tiny_ckpt, "tensor_parallel_size": 2, "pipeline_parallel_size": 2,
                     "enable_expert_parallel": True})
    params, warnings = read_model_json(str(tmp_path))
    args, _ = load_settings(params, str(tmp_path))
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (2, 2)
    assert args.enable_expert_parallel and not warnings


def test_wrong_value_of_a_mapped_key_fails_validation_naming_it(tmp_path, tiny_ckpt):
    write(tmp_path, {"model": tiny_ckpt, "max_num_seqs": 0})
    params, _ = read_model_json(str(tmp_path))
    with pytest.raises(ConfigError, match="'max_num_seqs'"):
        load_settings(params, str(tmp_path))
    write(tmp_path, {"model": "facebook/opt-125m"})
    with pytest.raises(ConfigError, match="nothing is downloaded"):
        load_settings(read_model_json(str(tmp_path))[0], str(tmp_path))


def test_vllm_backends_report_custom_metrics_key_sets_ours():
    from backend.triton_server.serving_config import parameters_from_model_config
    cfg = {"parameters": {"REPORT_CUSTOM_METRICS": {"string_value": "false"}, "model": {"string_value": "m"}}}
    assert parameters_from_model_config(cfg) == {"report_metrics": "false", "model": "m"}


def test_enable_lora_reads_multi_lora_json(tmp_path, tiny_ckpt):
    """The vLLM backend's layout: `enable_lora` in model.json, adapters in 1/multi_lora.json
    (relative folders from that folder)."""
    write(tmp_path, {"model": tiny_ckpt, "enable_lora": "true", "max_loras": 2, "max_lora_rank": 32})
    with pytest.raises(ConfigError, match="multi_lora.json"):
        read_model_json(str(tmp_path))
    (tmp_path / "1" / "multi_lora.json").write_text(json.dumps({"sql": "/abs/sql", "chat": "loras/chat"}))
    params, warnings = read_model_json(str(tmp_path))
    assert not warnings
    args, _ = load_settings(params, str(tmp_path))
    assert args.enable_lora and (args.max_loras, args.max_lora_rank) == (2, 32)
    assert args.lora_modules == {"sql": "/abs/sql", "chat": str(tmp_path / "1" / "loras" / "chat")}


def test_quantization_key_must_agree_with_the_checkpoint(tmp_path):
    """vLLM's `quantization: gptq | awq | compressed-tensors` (and the marlin names) are
    accepted when the checkpoint says the same; here the checkpoint decides the kernels."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq", "bits": 4}}))
    for ok in ("gptq", "gptq_marlin"):
        write(tmp_path, {"model": str(ckpt), "quantization": ok})
        read_model_json(str(tmp_path))
    write(tmp_path, {"model": str(ckpt), "quantization": "awq"})
    with pytest.raises(ConfigError, match="'awq', but the checkpoint's quantization_config says 'gptq'"):
        read_model_json(str(tmp_path))


def test_request_limits_come_from_config_pbtxt_strings_and_vllms_max_logprobs(tmp_path, tiny_ckpt):
    """Per-request limits are engine arguments: config.pbtxt parameters (strings), and
    vLLM's max_logprobs from model.json; an empty request_timeout_s means none."""
    write(tmp_path, {"model": tiny_ckpt, "max_logprobs": 5})
    params, warnings = read_model_json(str(tmp_path))
    assert params["max_logprobs"] == "5" and not warnings
    args, _ = load_settings({**params, "max_n": "8", "max_stop_strings": "4", "max_stop_string_len": "100",
                             "max_stop_token_ids": "10", "max_guided_spec_bytes": "4096",
                             "guided_compile_timeout_s": "2.5", "request_timeout_s": "30"}, str(tmp_path))
    assert (args.max_logprobs, args.max_n, args.max_stop_strings, args.max_stop_string_len, args.max_stop_token_ids,
            args.max_guided_spec_bytes, args.guided_compile_timeout_s, args.request_timeout_s) == (
        5, 8, 4, 100, 10, 4096, 2.5, 30.0)
    args, _ = load_settings({"model": tiny_ckpt, "request_timeout_s": ""}, str(tmp_path))
    assert args.request_timeout_s is None
    with pytest.raises(ConfigError, match="invalid parameter 'request_timeout_s'"):
        load_settings({"model": tiny_ckpt, "request_timeout_s": "-1"}, str(tmp_path))


def test_kv_offloading_and_kv_events_keys_carry_over(tmp_path, tiny_ckpt):
    write(tmp_path, {"model": tiny_ckpt, "kv_offloading_size": 2,
                     "kv_events_config": {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:5599"}})
    params, _ = read_model_json(str(tmp_path), "1")
    args = load_settings(params, str(tmp_path))[0]
    assert args.kv_offloading_size == 2 and args.kv_events_config.endpoint == "tcp://127.0.0.1:5599"
