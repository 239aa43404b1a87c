"""runner='pooling' (backend/engine/runner/pooling_runner.py): an embedding model's vectors equal
transformers' (fp32, <= 1e-5) for a Qwen3-Embedding-style checkpoint (the bare decoder
saved without its LM head), in a batch, with prompts prefilled in chunks, under
preemption, and with MEAN pooling; each request finishes with its vector and frees its
blocks; a generative engine refuses to pool and a pooling one to generate."""

import pytest
import torch
import torch.nn.functional as F

from backend import LLM
from backend.config import ConfigError, EngineArgs
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import hf_last_token_embeddings, make_embedding_checkpoint

LENGTHS = [5, 40, 70, 17, 33]


@pytest.fixture(scope="module")
def embed_ckpt(ckpt_dir):
    return make_embedding_checkpoint(str(ckpt_dir / "qwen3-embed"))


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and (a - b).abs().max().item() <= 1e-5


def test_last_token_pooling_equals_transformers_batched_and_chunked(embed_ckpt):
    prompts = random_prompts(len(LENGTHS), LENGTHS, seed=3)
    ref = hf_last_token_embeddings(embed_ckpt, prompts)
    # 32 tokens a step: the 40- and 70-token prompts are prefilled in chunks, beside others.
    llm = LLM(embed_ckpt, runner="pooling", block_size=16, num_kv_blocks=64, max_num_batched_tokens=32)
    outs = llm.embed(prompts)
    assert llm.stats()["num_chunked_prefills"] > 0
    for out, want in zip(outs, ref):
        assert out.finished and out.finish_reason == "stop" and out.token_ids == [] and out.error is None
        assert out.pooling_output.dtype == torch.float32 and close(out.pooling_output, want)
        assert abs(out.pooling_output.norm().item() - 1.0) < 1e-5
        assert out.num_prompt_tokens == len(out.prompt_token_ids)
    assert_pool_free(llm)
    # again: the prompts' blocks now come from the prefix cache; the last token is computed
    again = llm.embed(prompts)
    assert llm.stats()["prefix_cache_hit_tokens"] > 0
    assert all(close(o.pooling_output, w) for o, w in zip(again, ref))
    assert_pool_free(llm)


def test_mean_pooling_survives_chunks_and_preemption(embed_ckpt):
    from transformers import AutoModel
    prompts = random_prompts(4, [40, 45, 38, 50], seed=5)
    model = AutoModel.from_pretrained(embed_ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [model(torch.tensor([p])).last_hidden_state[0].mean(dim=0) for p in prompts]
    llm = LLM(embed_ckpt, runner="pooling", pooler_config={"pooling_type": "mean", "normalize": False},
              block_size=16, num_kv_blocks=16, max_num_batched_tokens=24)
    engine = llm.engine
    assert not engine.kv_cache.enable_prefix_caching     # a cached prefix would skip tokens of the mean
    outs = llm.embed(prompts)
    assert llm.stats()["num_chunked_prefills"] > 0
    for out, want in zip(outs, ref):
        assert close(out.pooling_output, want)
    assert_pool_free(llm)
    # Preempted after its first chunk (the scheduler's own path when the pool runs dry),
    # the request recomputes from token 0: its running sum starts again.
    request = engine.add_request(prompts[3])
    engine.step()
    assert 0 < request.num_computed_tokens < len(prompts[3])
    engine.scheduler._preempt(request)
    [out] = [o for _ in range(10) for o in engine.step() if o.finished][:1]
    assert request.num_preemptions == 1 and close(out.pooling_output, ref[3])
    assert_pool_free(llm)


def test_an_aborted_mean_request_leaves_no_running_sum(embed_ckpt):
    llm = LLM(embed_ckpt, runner="pooling", pooler_config='{"pooling_type": "MEAN"}', block_size=16,
              num_kv_blocks=16, max_num_batched_tokens=16)
    engine = llm.engine
    rid = engine.add_request(random_prompts(1, [60])[0]).request_id
    engine.step()                                   # its first chunk
    assert rid in engine.runner._sums
    engine.abort_request(rid)
    [other] = llm.embed([random_prompts(1, [8], seed=9)[0]])
    assert other.pooling_output is not None and engine.runner._sums == {}
    assert_pool_free(llm)


def test_pooling_and_generation_refuse_each_other(embed_ckpt, llama_ckpt):
    pooling = LLM(embed_ckpt, runner="pooling", block_size=16, num_kv_blocks=16)
    with pytest.raises(ValueError, match="LLM.embed"):
        pooling.generate([[5, 6, 7]])
    from backend.engine.errors import InvalidRequestError
    from backend.sampling_params import SamplingParams
    with pytest.raises(InvalidRequestError, match="structured output"):
        pooling.engine.add_request([5, 6], SamplingParams(guided_regex="a+"))
    with pytest.raises(InvalidRequestError, match="'prompt_logprobs' does not apply"):
        pooling.engine.add_request([5, 6], SamplingParams(prompt_logprobs=1))
    # a prompt may fill the whole context: nothing is generated after it
    max_len = pooling.engine.max_model_len
    assert pooling.embed([[5] * max_len])[0].pooling_output is not None
    with pytest.raises(ValueError, match="runner='pooling'"):
        LLM(llama_ckpt, block_size=16, num_kv_blocks=16).embed([[5, 6]])
    with pytest.raises(ConfigError, match="pooler_config is for runner='pooling'"):
        EngineArgs.create(model=llama_ckpt, pooler_config={"pooling_type": "LAST"})
    with pytest.raises(ConfigError, match="speculative_config"):
        EngineArgs.create(model=llama_ckpt, runner="pooling",
                          speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="pooling_type"):
        EngineArgs.create(model=llama_ckpt, runner="pooling", pooler_config={"pooling_type": "CLS"})
    assert not EngineArgs.create(model=llama_ckpt, runner="pooling").use_async_scheduling


def test_a_causal_lm_checkpoint_pools_too(llama_ckpt):
    """A *ForCausalLM checkpoint (with its LM head) served as an embedding model."""
    from transformers import AutoModel
    prompts = random_prompts(2, [9, 21], seed=4)
    model = AutoModel.from_pretrained(llama_ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [F.normalize(model(torch.tensor([p])).last_hidden_state[0, -1], dim=-1) for p in prompts]
    outs = LLM(llama_ckpt, runner="pooling", block_size=16, num_kv_blocks=16).embed(prompts)
    assert all(close(o.pooling_output, w) for o, w in zip(outs, ref))
