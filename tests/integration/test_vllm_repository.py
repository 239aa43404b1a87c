"""A vLLM-backend user's model repository, unchanged but for the `backend:` line: a
config.pbtxt with only `backend` and `instance_group`, engine arguments in `1/model.json`
with vLLM's names. Against a real tritonserver."""

import json
import os
import re

import pytest

from backend import LLM, SamplingParams
from clients.triton_client import StreamingRequest
from clients.tritonserver import TritonServer
from tests.integration.conftest import wait_blocks_free

# What the vLLM backend's sample config.pbtxt holds, with our backend's name.
CONFIG = 'backend: "paged_llm"\n\ninstance_group [\n  {\n    count: 1\n    kind: KIND_MODEL\n  }\n]\n'


def vllm_repo(root, engine_args: dict) -> str:
    model = os.path.join(root, "repo", "vllm_model")
    os.makedirs(os.path.join(model, "1"))
    with open(os.path.join(model, "config.pbtxt"), "w") as f:
        f.write(CONFIG)
    with open(os.path.join(model, "1", "model.json"), "w") as f:
        json.dump(engine_args, f)
    return os.path.join(root, "repo")


def test_vllm_repository_loads_and_serves(tmp_path, tiny_ckpt, lora_adapters):
    """With the vLLM backend's multi-LoRA layout too: `enable_lora` in model.json and the
    adapters in `1/multi_lora.json`; a request names one with `lora_name`. And with
    vLLM's `scheduling_policy: priority`: each request's `priority` shows in the metrics
    per priority class (backend/triton_server/priority_metrics.py); with
    `kv_offloading_size`, the host tier's series."""
    repo = vllm_repo(str(tmp_path), {"model": tiny_ckpt, "gpu_memory_utilization": 0.1, "enforce_eager": True,
                                     "num_gpu_blocks_override": 128, "disable_log_requests": True,
                                     "enable_lora": "true", "max_lora_rank": 8, "max_loras": 1,
                                     "scheduling_policy": "priority", "kv_offloading_size": 0.01})
    with open(os.path.join(repo, "vllm_model", "1", "multi_lora.json"), "w") as f:
        json.dump({"sql": lora_adapters["sql"]}, f)
    params = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    llm = LLM(tiny_ckpt, num_kv_blocks=128, lora_modules={"sql": lora_adapters["sql"]}, max_lora_rank=8)
    expected = {name: llm.generate(["The pass statement"], SamplingParams(**params, lora_name=name))[0]
                for name in (None, "sql")}
    with TritonServer(repo, log_path=str(tmp_path / "server.log")) as srv:
        for priority, (name, want) in enumerate(expected.items()):
            res = StreamingRequest(srv.grpc_url, model="vllm_model").run(
                "The pass statement", {**params, "priority": priority + 3, **({"lora_name": name} if name else {})})
            assert res.ok and res.token_ids == want.token_ids, name
        wait_blocks_free(srv, model="vllm_model")
        text = srv.metrics()
        for priority in (3, 4):
            assert re.search(r'^llm_time_to_first_token_by_priority_seconds_count\{[^}]*priority="%d"[^}]*\} 1$'
                             % priority, text, re.M), text[-3000:]
        assert re.search(r'^llm_num_requests_by_priority\{[^}]*state="running"[^}]*\} 0$', text, re.M)
        # ... and kv_offloading_size's host tier's (the prompt fills no block: nothing saved yet)
        assert re.search(r'^llm_kv_offload_saved_blocks_total\{[^}]*\} 0$', text, re.M), text[-3000:]
        assert re.search(r'^llm_kv_offload_host_blocks_total\{[^}]*\} [1-9]', text, re.M)
    log = open(tmp_path / "server.log").read()
    assert "model.json key 'disable_log_requests' has no effect with this backend; ignored" in log


def test_bad_model_json_value_fails_the_load_naming_the_key(tmp_path, tiny_ckpt):
    repo = vllm_repo(str(tmp_path), {"model": tiny_ckpt, "block_size": 0})
    srv = TritonServer(repo, log_path=str(tmp_path / "server.log"), startup_timeout_s=60)
    with pytest.raises((RuntimeError, TimeoutError)):
        srv.start()
    srv.stop()
    log = open(tmp_path / "server.log").read()
    assert "invalid parameter 'block_size'" in log and "model.json sets: block_size, model" in log


def test_server_without_metrics_still_serves(tmp_path, tiny_ckpt):
    """The vLLM backend's "metrics refused" case: `tritonserver --allow-metrics=false` with
    REPORT_CUSTOM_METRICS set. The model loads without them and serves. (This server has
    no metrics endpoint, so the pool is checked by a second request needing all of it.)"""
    repo = vllm_repo(str(tmp_path), {"model": tiny_ckpt, "num_gpu_blocks_override": 8, "block_size": 16})
    with open(os.path.join(repo, "vllm_model", "config.pbtxt"), "a") as f:
        f.write('parameters: { key: "REPORT_CUSTOM_METRICS" value: { string_value: "true" } }\n')
    params = {"max_tokens": 100, "min_tokens": 100, "temperature": 0, "ignore_eos": True}
    with TritonServer(repo, log_path=str(tmp_path / "server.log"), extra_args=["--allow-metrics=false"]) as srv:
        for _ in range(2):  # 8 blocks of 16 hold one such request: the second needs the first's blocks back
            res = StreamingRequest(srv.grpc_url, model="vllm_model").run("The pass statement", params)
            assert res.ok and len(res.token_ids) == 100
