"""Greedy output equals transformers' token for token (fp32, CPU), for every supported
architecture, with a batch mix that forces chunked prefill and preemption."""

import pytest

from backend import LLM, SamplingParams
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import hf_greedy, make_checkpoint

LENGTHS = [1, 200, 7, 64, 33, 150, 2, 99, 16, 120]
MAX_NEW = 24


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "llama3"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_matches_transformers(ckpt_dir, arch, prefix_caching):
    path = make_checkpoint(str(ckpt_dir / arch), arch)
    prompts = random_prompts(len(LENGTHS), LENGTHS, seed=1)
    expected = hf_greedy(path, prompts, MAX_NEW)
    # 100 blocks of 4 tokens cannot hold all ten sequences at once: preemption must happen.
    llm = LLM(path, block_size=4, num_kv_blocks=100, max_num_seqs=16, max_num_batched_tokens=48,
              enable_prefix_caching=prefix_caching)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0))
    for i, (out, ref) in enumerate(zip(outs, expected)):
        assert out.token_ids == ref, f"prompt {i} (len {len(prompts[i])}) differs"
        assert out.finish_reason == "length"
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_chunked_prefills"] > 0
    assert_pool_free(llm)


def test_triton_backend_matches_transformers(ckpt_dir):
    """The OpenAI Triton kernels inside the engine (interpreter on CPU): same greedy tokens
    as transformers in a mixed batch with chunked prefill and preemption."""
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    prompts = random_prompts(5, [1, 40, 9, 23, 17], seed=2)
    expected = hf_greedy(path, prompts, 8)
    llm = LLM(path, block_size=8, num_kv_blocks=7, max_num_seqs=8, max_num_batched_tokens=16,
              attention_backend="triton")
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, min_tokens=8, temperature=0))
    assert [o.token_ids for o in outs] == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0
    assert_pool_free(llm)


def test_llama_with_every_bias_matches_transformers(ckpt_dir):
    """attention_bias gives q, k, v and o_proj a bias in Hugging Face's Llama; mlp_bias
    gate, up and down."""
    path = make_checkpoint(str(ckpt_dir / "llama_bias"), "llama", attention_bias=True, mlp_bias=True)
    prompts = random_prompts(4, [1, 30, 9, 17], seed=4)
    expected = hf_greedy(path, prompts, 12)
    llm = LLM(path, block_size=8, num_kv_blocks=64, max_num_batched_tokens=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, min_tokens=12, temperature=0))
    assert [o.token_ids for o in outs] == expected
    assert_pool_free(llm)
