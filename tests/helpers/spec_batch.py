"""The batch the speculative-decoding tests with random heads share: ten random prompts
of 1 to 200 tokens and two that hit the prefix cache (on an engine whose pool cannot hold
them all and whose step budget chunks prompts), and the check that greedy output with
speculation equals the reference with each of those paths taken."""

from backend import LLM, SamplingParams
from tests.conftest import assert_pool_free, random_prompts

LENGTHS = [1, 200, 7, 64, 33, 150, 2, 99, 16, 120]
MAX_NEW = 24            # greedy tokens per prompt


def spec_prompts() -> list[list[int]]:
    ps = random_prompts(len(LENGTHS), LENGTHS, seed=1)
    return ps + [ps[3] + [5, 6, 7], ps[3][:40] + [9] * 30]      # prefix-cache hits


def assert_greedy_unchanged(llm: LLM, prompts: list[list[int]], reference: list[list[int]], max_new: int) -> None:
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_new, min_tokens=max_new, temperature=0))
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert out.token_ids == ref, f"prompt {i} differs"
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0 and stats["spec_decode_num_draft_tokens"] > 0
    assert_pool_free(llm)
