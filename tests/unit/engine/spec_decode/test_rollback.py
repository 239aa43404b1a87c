"""Scheduler and KV cache manager around a verification step, without a model: proposals
are budgeted and dropped before anyone is preempted; rejected ones give back their
slots and blocks and are never published to the prefix cache."""

from backend.engine.scheduling.kv_cache_manager import KVCacheManager
from backend.engine.outputs import ModelRunnerOutput
from backend.engine.request import Request
from backend.engine.scheduling.scheduler import Scheduler
from backend.sampling_params import SamplingParams


def _decoding(scheduler: Scheduler, prompt: list[int]) -> Request:
    r = Request(request_id="r", prompt_token_ids=prompt, sampling_params=SamplingParams(), arrival_time=0.0,
                max_tokens=32)
    scheduler.add_request(r)
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput([[50]]))   # the prefill's sampled token
    return r


def test_rejected_proposals_roll_back_slots_blocks_and_hashes():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    r = _decoding(scheduler, list(range(10, 17)))   # 7 prompt tokens + 1 output: blocks 0-1
    assert r.num_computed_tokens == 7 and len(kv.block_table("r")) == 2
    r.spec_token_ids = [60, 61, 62, 63]
    out = scheduler.schedule()
    (s,) = out.scheduled
    assert s.num_new_tokens == 5 and s.spec_token_ids == [60, 61, 62, 63] and r.spec_token_ids == []
    assert len(kv.block_table("r")) == 3              # positions 7..11
    # One proposal accepted, and the target's own token.
    scheduler.update_from_output(out, ModelRunnerOutput([[60, 70]]))
    assert s.num_rejected == 3 and r.output_token_ids == [50, 60, 70]
    assert r.num_computed_tokens == 9 and r.num_tokens == 10
    assert len(kv.block_table("r")) == 3              # position 9 (no K/V yet) is in block 2
    kv.cache_computed_blocks(r)
    assert kv._num_registered["r"] == 2               # blocks 0-1 are full of final tokens

    r.spec_token_ids = [80, 81, 82]
    out = scheduler.schedule()
    assert len(kv.block_table("r")) == 4              # positions 9..12
    scheduler.update_from_output(out, ModelRunnerOutput([[90]]))     # all rejected
    assert out.scheduled[0].num_rejected == 3
    assert r.num_computed_tokens == 10 and r.num_tokens == 11
    assert len(kv.block_table("r")) == 3              # block 3 held only rejected slots
    assert kv.num_free_blocks == 5
    kv.cache_computed_blocks(r)
    assert kv._num_registered["r"] == 2               # block 2 (positions 8..11) is not full yet
    scheduler.finish_request(r, None)
    assert kv.num_free_blocks == 8


def test_proposals_are_trimmed_by_the_budget_and_dropped_before_a_preemption():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=3)
    r = _decoding(scheduler, [5, 6, 7])              # 3 tokens: the budget in one step
    r.spec_token_ids = [1, 2, 3, 4]
    out = scheduler.schedule()
    (s,) = out.scheduled
    assert s.num_new_tokens == 3 and s.spec_token_ids == [1, 2]
    scheduler.update_from_output(out, ModelRunnerOutput([[1, 2, 9]]))   # all accepted
    scheduler.max_num_batched_tokens = 64
    r.spec_token_ids = list(range(20, 30))            # would need 3 more blocks; the pool has 1
    out = scheduler.schedule()
    assert not out.preempted and out.scheduled[0].num_new_tokens == 1 and out.scheduled[0].spec_token_ids == []
