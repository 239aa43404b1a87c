"""EAGLE-3 speculative decoding (fp32, CPU): a random head in the published layout on a
random Llama. Its proposals equal a dense reference drafter's (so the catch-up, the
target's layer inputs and the head's own continuation line up), greedy output equals
speculation off with chunked prefill, preemption, prefix hits and async scheduling, and
the pool ends free. The trained head on the trained target: test_eagle_trained.py."""

import pytest

from backend import LLM, SamplingParams
from backend.config import ConfigError
from builder.eagle3_head import random_head
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import hf_greedy, make_checkpoint
from tests.helpers.eagle_reference import DenseEagle3

LENGTHS = [1, 200, 7, 64, 33, 150, 2, 99, 16, 120]
MAX_NEW = 24
# 100 blocks of 4 tokens cannot hold the ten sequences at once: preemption must happen.
ENGINE = dict(block_size=4, num_kv_blocks=100, max_num_seqs=16, max_num_batched_tokens=48, dtype="float32")


@pytest.fixture(scope="module")
def target(ckpt_dir):
    # Four layers: the head reads three of them (1, 2 and 3 here).
    return make_checkpoint(str(ckpt_dir / "llama_eagle_target"), "llama", initializer_range=0.05,
                           num_hidden_layers=4)


@pytest.fixture(scope="module")
def head(target, ckpt_dir):
    """A reduced draft vocabulary (d2t) of 200 of the 320 ids."""
    return random_head(target, str(ckpt_dir / "eagle3_head"), seed=3, draft_vocab=200)


@pytest.fixture(scope="module")
def prompts():
    ps = random_prompts(len(LENGTHS), LENGTHS, seed=1)
    return ps + [ps[3] + [5, 6, 7], ps[3][:40] + [9] * 30]      # prefix-cache hits


@pytest.fixture(scope="module")
def reference(target, prompts):
    return hf_greedy(target, prompts, MAX_NEW)


def eagle(head: str, k: int) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k}


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_is_unchanged(target, head, prompts, reference, k, async_scheduling):
    llm = LLM(target, speculative_config=eagle(head, k), async_scheduling=async_scheduling, **ENGINE)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0))
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert out.token_ids == ref, f"prompt {i} differs"
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert_pool_free(llm)


def _recording(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """Every proposal the head makes: (the request's tokens then, the proposals)."""
    scheduler, seen = llm.engine.scheduler, []
    set_proposals = scheduler.set_proposals

    def record(proposals):
        for request_id, (tokens, _) in proposals.tokens.items():
            request = scheduler.requests.get(request_id)
            if request is not None:
                seen.append((list(request.all_token_ids), list(tokens.tolist())))
        set_proposals(proposals)
    scheduler.set_proposals = record
    return seen


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_proposals_equal_a_dense_reference(target, head, prompts, async_scheduling):
    """Each proposal chain equals the dense drafter's over the request's tokens at that
    point (where its choice is not a near-tie), through chunked prefill and preemption.
    Prefix caching is off: a hit block's last head entry was written with its first
    computer's next token, a legitimate difference."""
    llm = LLM(target, speculative_config=eagle(head, 3), async_scheduling=async_scheduling,
              enable_prefix_caching=False, **ENGINE)
    seen = _recording(llm)
    llm.generate(prompts[:10], SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0))
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0
    dense = DenseEagle3(head, target)
    checked = 0
    for tokens, proposed in seen[::3]:          # (a third of them: the reference is slow)
        want, margins = dense.propose(tokens, len(proposed))
        for j, (got, ref, margin) in enumerate(zip(proposed, want, margins)):
            if margin < 1e-3:
                break               # a near-tie: what follows continues from another token
            assert got == ref, f"proposal {j + 1} after {len(tokens)} tokens"
            checked += 1
    assert checked > 100
    assert_pool_free(llm)


def test_bad_heads_are_refused_naming_the_argument(target, head, tmp_path, ckpt_dir):
    two_layers = make_checkpoint(str(ckpt_dir / "llama"), "llama")     # (the suite's 2-layer Llama)
    with pytest.raises(ConfigError, match="speculative_config.model.*three distinct layers"):
        LLM(two_layers, speculative_config=eagle(head, 2), num_kv_blocks=64)
    with pytest.raises(ConfigError, match="speculative_config.model.*not an EAGLE-3 head"):
        LLM(target, speculative_config=eagle(target, 2), num_kv_blocks=64)
    with pytest.raises(ConfigError, match="speculative_config.model.*no checkpoint"):
        LLM(target, speculative_config=eagle(str(tmp_path / "nope"), 2), num_kv_blocks=64)
    with pytest.raises(ConfigError, match="cpu_forward_shards"):
        LLM(target, speculative_config=eagle(head, 2), num_kv_blocks=64, cpu_forward_shards=2)
