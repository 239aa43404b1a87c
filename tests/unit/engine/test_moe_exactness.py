"""Mixture-of-experts families: greedy output equals transformers' token for token
(fp32, CPU) in a mixed batch with chunked prefill, preemption and prefix-cache hits; one
family also with the Triton kernels (attention and fused MoE) under the interpreter."""

import random

import pytest

from backend import LLM, SamplingParams
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import hf_greedy
from tests.helpers.moe_checkpoints import MOE_ARCHS, make_moe_checkpoint
from tests.helpers.pins import require_pinned

LENGTHS = [1, 120, 7, 64, 33, 90, 2, 16]
MAX_NEW = 16


def prompts_with_shared_prefixes(seed: int) -> list[list[int]]:
    prompts = random_prompts(len(LENGTHS), LENGTHS, seed=seed)
    rng = random.Random(seed)
    # Two more that extend earlier prompts: prefix-cache hits once those are cached.
    return prompts + [prompts[1] + [rng.randrange(3, 320) for _ in range(5)], prompts[3][:40] + [7, 8, 9]]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_greedy_matches_transformers(ckpt_dir, arch):
    if arch == "gpt_oss":
        require_pinned("transformers")    # other versions' references differ: tests/helpers/pins.py
    path = make_moe_checkpoint(str(ckpt_dir / arch), arch)
    prompts = prompts_with_shared_prefixes(seed=3)
    expected = hf_greedy(path, prompts, MAX_NEW)
    # 70 blocks of 4 tokens cannot hold every sequence at once: preemption must happen.
    # Mixtral's window (48 tokens on every layer) frees the blocks outside it as sequences
    # grow, so its pool is smaller.
    llm = LLM(path, block_size=4, num_kv_blocks=45 if arch == "mixtral" else 70, max_num_seqs=16,
              max_num_batched_tokens=48,
              enable_prefix_caching=True)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0))
    for i, (out, ref) in enumerate(zip(outs, expected)):
        assert out.token_ids == ref, f"prompt {i} (len {len(prompts[i])}) differs"
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_chunked_prefills"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    assert_pool_free(llm)


def test_moe_triton_kernels_match_transformers(ckpt_dir):
    """attention_backend="triton": the fused MoE kernel and the attention / layer kernels
    under the interpreter, chunked prefill and preemption included."""
    path = make_moe_checkpoint(str(ckpt_dir / "qwen2_moe"), "qwen2_moe")
    prompts = random_prompts(4, [1, 30, 9, 21], seed=5)
    expected = hf_greedy(path, prompts, 6)
    llm = LLM(path, block_size=8, num_kv_blocks=7, max_num_seqs=8, max_num_batched_tokens=16,
              attention_backend="triton")
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, min_tokens=6, temperature=0))
    assert [o.token_ids for o in outs] == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0
    assert_pool_free(llm)
