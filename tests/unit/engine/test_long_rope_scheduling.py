"""LongRoPE in the scheduler, without a model: a short-mode request whose next token lies
past the original context is restarted in long mode (its KV freed, its prefix-cache
chain salted anew), in decode and when a request preempted while short comes back longer.
Exactness against transformers: tests/unit/models/test_gemma_phi3.py."""

from backend.engine.scheduling.kv_cache_manager import KVCacheManager
from backend.engine.outputs import ModelRunnerOutput
from backend.engine.request import Request
from backend.engine.scheduling.scheduler import Scheduler
from backend.models.rotary import long_rope_salt
from backend.sampling_params import SamplingParams

ORIGINAL = 8


def _setup(prompt_len: int) -> tuple[Scheduler, KVCacheManager, Request]:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.long_rope_original = ORIGINAL
    r = Request(request_id="r", prompt_token_ids=list(range(10, 10 + prompt_len)), sampling_params=SamplingParams(),
                arrival_time=0.0, max_tokens=32)
    scheduler.add_request(r)
    return scheduler, kv, r


def test_decode_into_position_original_restarts_in_long_mode():
    scheduler, kv, r = _setup(6)
    for token in (50, 51, 52):                       # positions 6, 7, 8 sampled
        out = scheduler.schedule()
        assert [s.request for s in out.scheduled] == [r] and not r.long_rope
        scheduler.update_from_output(out, ModelRunnerOutput([[token]]))
    assert r.num_tokens == 9 and r.num_computed_tokens == 8 and kv.block_table("r")
    # The next step would compute position 8 = ORIGINAL: restarted instead.
    out = scheduler.schedule()
    assert out.preempted == [r] and not out.scheduled
    assert r.long_rope and r.cache_salt == long_rope_salt(None) and r.block_hashes == []
    assert r.num_computed_tokens == 0 and kv.block_table("r") == [] and r.num_preemptions == 0
    assert scheduler.num_long_rope_restarts == 1 and scheduler.num_preemptions == 0
    out = scheduler.schedule()                       # recomputed whole, in long mode
    assert out.scheduled[0].num_new_tokens == 9
    # The short-mode blocks stay cached under the unsalted chain, not found by the long one.
    assert kv.prefix_cache_hit_tokens == 0
    _finish(scheduler, kv, r)


def test_preempted_short_request_back_longer_enters_long_mode_at_admission():
    scheduler, kv, r = _setup(9)                     # as a request preempted at 9 tokens
    out = scheduler.schedule()
    assert r.long_rope and out.scheduled[0].num_new_tokens == 9
    assert scheduler.num_long_rope_restarts == 0     # it held no KV: nothing to restart
    _finish(scheduler, kv, r)


def test_prompt_within_the_original_context_stays_short():
    scheduler, kv, r = _setup(ORIGINAL)
    out = scheduler.schedule()
    assert not r.long_rope and out.scheduled[0].num_new_tokens == ORIGINAL and r.cache_salt is None
    _finish(scheduler, kv, r)


def _finish(scheduler: Scheduler, kv: KVCacheManager, r: Request) -> None:
    scheduler.abort_request(r.request_id)
    assert kv.num_free_blocks == kv.num_total_blocks
