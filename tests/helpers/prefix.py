"""Shared check: FP8 KV cache with prefix caching gives the same tokens as without."""

from backend import LLM, SamplingParams
from tests.conftest import assert_pool_free, random_prompts


def check_fp8_prefix_caching(path: str, prefix_len: int, seed: int) -> LLM:
    """Prefix-cache hits read the same FP8 bytes a fresh prefill wrote: identical output.
    Returns the prefix-caching LLM for further checks (its pool is verified free)."""
    prefix = random_prompts(1, [prefix_len], vocab=4000, seed=seed)[0]
    prompts = [prefix + [7, 8, 9], prefix + [10, 11]]
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)
    off = LLM(path, block_size=16, num_kv_blocks=64, kv_cache_dtype="fp8",
              enable_prefix_caching=False).generate(prompts, params)
    llm = LLM(path, block_size=16, num_kv_blocks=64, kv_cache_dtype="fp8", enable_prefix_caching=True)
    on = [llm.generate([p], params)[0] for p in prompts]
    assert on[1].num_cached_tokens == prefix_len // 16 * 16
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert_pool_free(llm)
    return llm
