"""Sliding windows save memory (issue 29 part 5): when every layer has a window
(Mistral-style), blocks wholly before every future query's window go back to the pool
during generation, so a sequence holds at most window / block_size + 1 blocks, and the
output is still transformers' token for token, with preemption and prefix hits."""

import pytest

from backend import LLM, SamplingParams
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import hf_greedy, make_checkpoint

WINDOW, BLOCK = 8, 4


@pytest.fixture(scope="module")
def mistral_w8(ckpt_dir):
    return make_checkpoint(str(ckpt_dir / "mistral-w8"), "mistral", sliding_window=WINDOW)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("async_scheduling", [None, False])
def test_long_generation_holds_window_blocks(mistral_w8, prefix_caching, async_scheduling):
    prompts = random_prompts(3, [21, 5, 13], seed=7)
    new = 60
    expected = hf_greedy(mistral_w8, prompts, new)
    llm = LLM(mistral_w8, block_size=BLOCK, num_kv_blocks=64, max_num_batched_tokens=16,
              enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling)
    engine = llm.engine
    params = SamplingParams(max_tokens=new, min_tokens=new, temperature=0)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, f"r{i}")
    outputs, peak = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        running = engine.scheduler.running
        if running and all(r.num_output_tokens for r in running):
            # Every sequence generating (a prompt chunk of n tokens holds (n + window) /
            # block_size blocks while it runs): the pool's count is the bound.
            stats = engine.stats()
            used = stats["num_total_blocks"] - stats["num_free_blocks"]
            assert used <= len(running) * (WINDOW // BLOCK + 1), (used, len(running))
            peak = max(peak, used)
    assert [outputs[f"r{i}"] for i in range(3)] == expected
    # Without freeing, 3 sequences of ~80 tokens would hold ~60 blocks at the end.
    assert 0 < peak <= 3 * (WINDOW // BLOCK + 1)
    assert_pool_free(llm)


def test_mixed_batch_with_preemption_and_prefix_hits(ckpt_dir):
    """Windows shorter than the prompts, a pool that still forces preemption (a window of
    32 tokens: 9 blocks per generating sequence, 12 sequences, 32 blocks), prompts
    sharing a prefix with blocks freed (but kept cached) by the sequence that computed
    them."""
    path = make_checkpoint(str(ckpt_dir / "mistral-w32"), "mistral", sliding_window=32)
    lengths = [1, 100, 7, 64, 33, 90, 2, 99, 16, 80]
    prompts = random_prompts(len(lengths), lengths, seed=1)
    prompts += [prompts[1][:60] + [5, 6, 7], prompts[5][:50] + [9]]
    expected = hf_greedy(path, prompts, 24)
    llm = LLM(path, block_size=BLOCK, num_kv_blocks=32, max_num_seqs=16, max_num_batched_tokens=48)
    assert llm.engine.kv_cache.sliding_window == 32
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, min_tokens=24, temperature=0))
    for i, (out, ref) in enumerate(zip(outs, expected)):
        assert out.token_ids == ref, f"prompt {i} (len {len(prompts[i])}) differs"
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    assert_pool_free(llm)


def test_mixed_full_and_sliding_layers_free_nothing(ckpt_dir):
    """Gemma 2 alternates sliding and full layers: the full ones need every block."""
    path = make_checkpoint(str(ckpt_dir / "gemma2"), "gemma2")
    llm = LLM(path, block_size=BLOCK, num_kv_blocks=64)
    assert llm.engine.kv_cache.sliding_window is None
    out = llm.generate([random_prompts(1, [30], seed=2)[0]], SamplingParams(max_tokens=4, temperature=0))
    assert out[0].token_ids == hf_greedy(path, [random_prompts(1, [30], seed=2)[0]], 4)[0]
    assert_pool_free(llm)
