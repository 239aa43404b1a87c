"""OLMo 2 (backend/models/olmo2.py), a second new architecture in its model file and a
table line: greedy output equals transformers' token for token (fp32, CPU) in a batch
mix with chunked prefill, preemption and prefix caching; tensor parallelism is refused
with the table's reason."""

import pytest

from backend import LLM, SamplingParams
from backend.config import ConfigError
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import hf_greedy, make_checkpoint

LENGTHS = [1, 70, 7, 33, 120, 16]
MAX_NEW = 16


def test_greedy_matches_transformers(ckpt_dir):
    path = make_checkpoint(str(ckpt_dir / "olmo2"), "olmo2")
    prompts = random_prompts(len(LENGTHS), LENGTHS, seed=7)
    prompts.append(prompts[1][:50] + [3, 4])            # shares a prefix with the second
    expected = hf_greedy(path, prompts, MAX_NEW)
    llm = LLM(path, block_size=4, num_kv_blocks=70, max_num_seqs=8, max_num_batched_tokens=40)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0))
    assert [o.token_ids for o in outs] == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    assert_pool_free(llm)


def test_two_ranks_are_refused_with_the_reason(ckpt_dir):
    path = make_checkpoint(str(ckpt_dir / "olmo2"), "olmo2")
    with pytest.raises((ConfigError, ValueError), match="q/k norms span every head"):
        LLM(path, tensor_parallel_size=2, block_size=8, num_kv_blocks=16)
