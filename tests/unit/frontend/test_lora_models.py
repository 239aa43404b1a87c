"""The frontend serves each LoRA adapter of a Triton model as a model of its own: from the
model's `lora_modules` parameter or the vLLM backend's `1/multi_lora.json`, and a request
naming the adapter goes to its Triton model with `lora_name` set."""

import asyncio
import json

from frontend.openai_api import triton_client
from frontend.openai_api.triton_client import ServedModel, TritonLLM


def test_adapters_from_parameter_and_multi_lora_json(tmp_path):
    async def run():
        llm = TritonLLM("127.0.0.1:1", model_repository=str(tmp_path))
        assert llm._adapters("llm", {"lora_modules": '{"sql": "loras/sql", "chat": "/abs"}'}) == ["sql", "chat"]
        assert llm._adapters("llm", {"lora_modules": "sql=loras/sql chat=/abs"}) == ["sql", "chat"]
        (tmp_path / "vllm_model" / "1").mkdir(parents=True)
        (tmp_path / "vllm_model" / "1" / "multi_lora.json").write_text(json.dumps({"a": "/x"}))
        assert llm._adapters("vllm_model", {}) == ["a"]
        assert llm._adapters("other", {}) == []
        await llm.close()
    asyncio.run(run())


def test_a_request_for_an_adapter_goes_to_its_model(monkeypatch):
    sent = []
    monkeypatch.setattr(triton_client, "Generation", lambda client, model, prompt, sampling, *a: sent.append(
        (model, sampling)))

    async def run():
        llm = TritonLLM("127.0.0.1:1")
        llm._models = {"llm": ServedModel("llm", None, 0, "llm"), "sql": ServedModel("sql", None, 0, "llm", "sql")}
        llm.generate("sql", "hi", {"max_tokens": 3}, stream=False, logprobs=False)
        llm.generate("llm", "hi", {"max_tokens": 3}, stream=False, logprobs=False)
        assert llm._models["sql"].parent == "llm" and llm._models["llm"].parent is None
        await llm.close()
    asyncio.run(run())
    assert sent == [("llm", {"max_tokens": 3, "lora_name": "sql"}), ("llm", {"max_tokens": 3})]


def test_listing_reads_max_model_len_for_chat_checks(tmp_path):
    """The config's max_model_len, else the checkpoint's max_position_embeddings; an
    adapter has its model's (the frontend refuses a chat that cannot fit: chat.py)."""
    ckpt = tmp_path / "llm" / "ckpt"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))

    class FakeClient:
        def __init__(self, params):
            self.params = params

        async def get_model_repository_index(self, **_):
            return {"models": [{"name": "llm", "state": "READY"}]}

        async def get_model_config(self, name, **_):
            return {"config": {"backend": "paged_llm", "parameters": {k: {"string_value": v}
                                                                      for k, v in self.params.items()}}}

    async def run(params):
        llm = TritonLLM("127.0.0.1:1", model_repository=str(tmp_path))
        await llm.client.close()
        llm.client = FakeClient({"model": "ckpt", "lora_modules": "sql=/x", **params})
        return {name: m.max_model_len for name, m in (await llm.models()).items()}
    assert asyncio.run(run({"max_model_len": "1024"})) == {"llm": 1024, "sql": 1024}
    assert asyncio.run(run({})) == {"llm": 4096, "sql": 4096}


def test_an_embedding_model_is_known_by_its_runner(tmp_path):
    """config.pbtxt's `runner` parameter, or a vLLM-backend `1/model.json`'s (/v1/embeddings)."""
    async def run():
        llm = TritonLLM("127.0.0.1:1", model_repository=str(tmp_path))
        assert llm._runner("emb", {"runner": "pooling"}) == "pooling"
        (tmp_path / "vllm_emb" / "1").mkdir(parents=True)
        (tmp_path / "vllm_emb" / "1" / "model.json").write_text(json.dumps({"model": "/x", "runner": "pooling"}))
        assert llm._runner("vllm_emb", {}) == "pooling" and llm._runner("llm", {}) == "generate"
        await llm.close()
    asyncio.run(run())
