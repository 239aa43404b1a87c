"""scheduling/kv_handoff.py without a transport: only a prefill engine keeps blocks (a
client of any other engine that asks is refused, so no one can pin the pool); a kept
run of blocks is the request's leading computed blocks, released on request or on
expiry; an import reserves only what the pool lacks and commits it as prefix hits."""

import pytest

from backend.config import EngineArgs
from backend.engine.errors import InvalidRequestError
from backend.engine.llm_engine import LLMEngine
from backend.sampling_params import SamplingParams
from tests.conftest import assert_pool_free, random_prompts

KEEP = SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True})


@pytest.fixture()
def engine(tiny_ckpt):
    e = LLMEngine(EngineArgs(model=tiny_ckpt, num_kv_blocks=32, max_model_len=256))
    yield e
    e.shutdown()


def finish(engine, prompt, params, request_id):
    engine.add_request(prompt, params, request_id)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o if o.finished else out
    return out


def test_an_engine_that_is_not_a_prefill_engine_refuses_to_keep_blocks(engine):
    with pytest.raises(InvalidRequestError, match="kv_transfer_params"):
        engine.add_request([5] * 40, KEEP, "r")
    assert_pool_free(engine)


def test_kept_blocks_are_the_leading_computed_ones_until_released_or_expired(engine):
    engine.handoff.start_holding()
    prompt = random_prompts(1, [70], vocab=300, seed=1)[0]
    out = finish(engine, prompt, KEEP, "a")
    kept = out.kv_transfer_params["remote_block_ids"]
    assert len(kept) == 4 and out.kv_transfer_params["num_remote_tokens"] == 64
    by_id = {b.block_id: b for b in engine.kv_cache.pool.blocks}
    assert [by_id[i].ref_cnt for i in kept] == [1] * 4 and all(by_id[i].block_hash for i in kept)
    assert engine.stats()["num_used_blocks"] == 4
    assert engine.handoff.release("a") and not engine.handoff.release("a")
    assert_pool_free(engine)
    finish(engine, prompt, KEEP, "b")
    assert engine.handoff.expire(now=0.0) == 0          # (not yet due)
    assert engine.handoff.expire(now=float("inf")) == 1
    assert_pool_free(engine)


def test_an_import_reserves_what_is_missing_and_commits_it_as_prefix_hits(engine):
    """The transport's copy stood in for by copying the blocks' bytes by hand."""
    prompt = random_prompts(1, [70], vocab=300, seed=2)[0]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = finish(engine, prompt, greedy, "ref").token_ids      # (this caches the prompt's 4 full blocks)
    kv = engine.kv_cache
    saved = {h: [(layer.key[b.block_id].clone(), layer.value[b.block_id].clone()) for layer in engine.runner.kv_caches]
             for h, b in kv.pool.cached.items()}
    kv.reset_prefix_cache()
    ticket = engine.reserve_import(prompt, greedy, 4)
    assert ticket.num_cached == 0 and len(ticket.blocks) == 4
    engine.handoff.abort_import(ticket)                   # a failed copy: nothing registered
    assert_pool_free(engine)
    assert not kv.pool.cached
    ticket = engine.reserve_import(prompt, greedy, 4)
    for block, block_hash in zip(ticket.blocks, ticket.hashes):
        for layer, (k, v) in zip(engine.runner.kv_caches, saved[block_hash]):
            layer.key[block.block_id], layer.value[block.block_id] = k, v
    assert engine.handoff.commit_import(ticket) == 4
    assert engine.reserve_import(prompt, greedy, 4) is None        # all cached now: nothing to bring
    out = finish(engine, prompt, greedy, "imported")
    assert out.token_ids == want and out.num_cached_tokens == 64
    # A longer prompt over the same start: only its new full block is reserved.
    longer = prompt + random_prompts(1, [20], vocab=300, seed=3)[0]
    ticket = engine.reserve_import(longer, greedy, 5)
    assert ticket.num_cached == 4 and len(ticket.blocks) == 1
    engine.handoff.abort_import(ticket)
    assert_pool_free(engine)


def test_a_copy_that_could_not_be_stopped_keeps_its_blocks_out_of_the_pool(engine):
    prompt = random_prompts(1, [70], vocab=300, seed=4)[0]
    greedy = SamplingParams(temperature=0, max_tokens=2)
    finish(engine, prompt, greedy, "warm")                  # (its first 2 blocks cached)
    ticket = engine.reserve_import(prompt[:40] + [7] * 30, greedy, 4)
    assert ticket.num_cached == 2 and [b.ref_cnt for b in ticket.pinned] == [1, 1]     # pinned while it lasts
    engine.handoff.quarantine_import(ticket)
    assert [b.ref_cnt for b in ticket.pinned] == [0, 0] and [b.ref_cnt for b in ticket.blocks] == [1, 1]
    assert engine.stats()["kv_handoff_quarantined_blocks"] == 2
    assert engine.stats()["num_used_blocks"] == 2
