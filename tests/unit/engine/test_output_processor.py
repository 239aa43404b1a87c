"""OutputProcessor alone (no model): several tokens landing in one step are checked for
stops one at a time; the first stop ends the request there and drops the rest."""

from backend.engine.kv_cache_manager import KVCacheManager
from backend.engine.output_processor import OutputProcessor
from backend.engine.request import Request, RequestStatus
from backend.engine.scheduler import Scheduler
from backend.sampling_params import SamplingParams


def _running(scheduler: Scheduler, params: SamplingParams, max_tokens: int = 16) -> Request:
    r = Request(request_id="r", prompt_token_ids=[3, 4], sampling_params=params, arrival_time=0.0,
                max_tokens=max_tokens, eos_token_ids=frozenset([2]))
    scheduler.add_request(r)
    scheduler.schedule()
    assert r.status == RequestStatus.RUNNING
    return r


def _processor():
    scheduler = Scheduler(KVCacheManager(8, 4, True), max_num_seqs=4, max_num_batched_tokens=64)
    return OutputProcessor(None, scheduler), scheduler


def test_a_stop_id_inside_the_accepted_tokens_ends_the_request_there():
    outputs, scheduler = _processor()
    r = _running(scheduler, SamplingParams(stop_token_ids=[9]))
    outputs.add(r)
    first = outputs.append_tokens(r, [5, 6], None, now=1.0)
    assert first.new_token_ids == [5, 6] and not first.finished
    last = outputs.append_tokens(r, [7, 9, 8, 8], None, now=2.0)
    assert last.finished and last.finish_reason == "stop"
    assert last.new_token_ids == [7, 9] and last.token_ids == [5, 6, 7, 9]
    assert outputs.num_generation_tokens_total == 4 and scheduler.num_unfinished == 0
    assert r.first_token_time == 1.0


def test_min_tokens_and_max_tokens_count_each_token():
    outputs, scheduler = _processor()
    r = _running(scheduler, SamplingParams(min_tokens=3), max_tokens=5)
    outputs.add(r)
    out = outputs.append_tokens(r, [2, 2, 5], None, now=1.0)      # EOS before min_tokens: kept going
    assert not out.finished and out.new_token_ids == [2, 2, 5]
    out = outputs.append_tokens(r, [6, 7, 8], None, now=2.0)      # max_tokens 5 reached at 7
    assert out.finished and out.finish_reason == "length" and out.token_ids == [2, 2, 5, 6, 7]
