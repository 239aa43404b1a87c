"""Priority scheduling (backend/engine/scheduling/priority.py and the scheduler's priority
step, priority_admission.py), the scheduler alone against a fake runner: admission by (priority, arrival), a waiting request taking the
place of a lower-priority running one (never of an equal or higher one), the pool's
last blocks taken from the lowest priority, and every request done with the pool free.
Through the engine, with greedy tokens equal to FCFS's: test_priority_engine.py."""

import pytest

from backend.config import EngineArgs
from backend.engine.outputs import ModelRunnerOutput
from backend.engine.request import Request
from backend.engine.scheduling.kv_cache_manager import KVCacheManager
from backend.engine.scheduling.priority import PriorityQueue
from backend.engine.scheduling.scheduler import Scheduler
from backend.sampling_params import SamplingParams


def request(rid: str, prompt_len: int, priority: int, arrival: float, max_tokens: int = 4) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(range(10, 10 + prompt_len)),
                   sampling_params=SamplingParams(max_tokens=max_tokens, priority=priority), arrival_time=arrival,
                   max_tokens=max_tokens, eos_token_ids=frozenset({2}))


def setup(num_blocks: int = 32, max_num_seqs: int = 4, budget: int = 64) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4, enable_prefix_caching=False)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy="priority"), kv


def step(scheduler: Scheduler) -> tuple[list[str], list[str], list[str]]:
    """(scheduled ids, preempted ids, finished ids) of one step with a fake runner."""
    out = scheduler.schedule()
    result = ModelRunnerOutput([[7] if s.completes_prompt else [] for s in out.scheduled])
    finished = [o.request_id for o in scheduler.update_from_output(out, result) if o.finish_reason]
    return [s.request.request_id for s in out.scheduled], [r.request_id for r in out.preempted], finished


def run_to_end(scheduler: Scheduler, kv: KVCacheManager) -> list[str]:
    order = []
    for _ in range(200):
        if not scheduler.num_unfinished:
            break
        order += step(scheduler)[2]
    assert not scheduler.num_unfinished and kv.num_free_blocks == kv.num_total_blocks
    return order


def test_the_queue_keeps_priority_then_arrival_order():
    q = PriorityQueue()
    for rid, priority, arrival in [("a", 1, 0.0), ("b", 0, 2.0), ("c", 1, 1.0), ("d", 0, 1.0), ("e", -1, 9.0)]:
        q.append(request(rid, 1, priority, arrival))
    assert [r.request_id for r in q] == ["e", "d", "b", "a", "c"]
    first = q.popleft()
    q.appendleft(first)                                  # put back: to its place, which is first
    q.extendleft([q.popleft(), q.popleft()][::-1])
    assert [r.request_id for r in q] == ["e", "d", "b", "a", "c"]


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    scheduler, kv = setup(max_num_seqs=1)
    for rid, priority, arrival in [("low", 5, 0.0), ("mid", 1, 1.0), ("high", 0, 2.0), ("high2", 0, 3.0)]:
        scheduler.add_request(request(rid, 4, priority, arrival, max_tokens=1))
    assert run_to_end(scheduler, kv) == ["high", "high2", "mid", "low"]


def test_a_waiting_request_takes_the_place_of_a_lower_priority_running_one():
    scheduler, kv = setup(max_num_seqs=2)
    scheduler.add_request(request("low", 4, 5, 0.0, max_tokens=20))
    scheduler.add_request(request("mid", 4, 3, 1.0, max_tokens=20))
    # (two steps: "low"'s prompt sits out the step of "mid"'s first token)
    order = step(scheduler)[2] + step(scheduler)[2]
    assert {r.request_id for r in scheduler.running} == {"low", "mid"}
    scheduler.add_request(request("high", 4, 0, 2.0, max_tokens=4))
    scheduled, preempted, finished = step(scheduler)
    assert preempted == ["low"] and "high" in scheduled and "mid" in scheduled
    # An equal priority waits its turn: no preemption for it.
    scheduler.add_request(request("mid2", 4, 3, 3.0, max_tokens=2))
    _, preempted, more = step(scheduler)
    assert preempted == []
    order += finished + more + run_to_end(scheduler, kv)
    assert order.index("high") < order.index("mid") < order.index("low")
    assert order.index("mid2") < order.index("low")


def test_better_ranked_arrivals_take_their_places_in_one_step():
    """Four low-priority requests fill max_num_seqs; two high-priority ones arrive
    together: both are admitted in the next step, the two lowest-ranked (the latest)
    preempted for them, not one a step."""
    scheduler, kv = setup(max_num_seqs=4)
    for i in range(4):
        scheduler.add_request(request(f"low{i}", 4, 5, float(i), max_tokens=20))
    for _ in range(3):
        step(scheduler)
    assert len(scheduler.running) == 4
    scheduler.add_request(request("high0", 4, 0, 10.0, max_tokens=4))
    scheduler.add_request(request("high1", 4, 0, 11.0, max_tokens=4))
    scheduled, preempted, _ = step(scheduler)
    assert preempted == ["low3", "low2"] and {"high0", "high1"} <= set(scheduled)
    run_to_end(scheduler, kv)


def test_room_is_made_only_for_the_best_waiting_rank():
    """(A review's case.) "mid" would sit out behind "high"'s first token in its step:
    no running request is preempted for it there, only one for "high"."""
    scheduler, kv = setup(max_num_seqs=3)
    scheduler.add_request(request("p", 40, 5, 0.0, max_tokens=20))
    scheduler.add_request(request("d1", 4, 9, 1.0, max_tokens=20))
    scheduler.add_request(request("d2", 4, 9, 2.0, max_tokens=20))
    for _ in range(3):
        step(scheduler)
    assert len(scheduler.running) == 3
    scheduler.add_request(request("high", 4, 0, 10.0, max_tokens=4))
    scheduler.add_request(request("mid", 4, 7, 11.0, max_tokens=4))
    scheduled, preempted, _ = step(scheduler)
    assert preempted == ["d2"] and "high" in scheduled and "mid" not in scheduled
    run_to_end(scheduler, kv)


def test_the_pool_is_taken_from_the_lowest_priority_never_a_higher_one():
    # 10 blocks of 4 tokens: three 12-token prompts fill 9; growing, someone must go.
    scheduler, kv = setup(num_blocks=10, budget=64)
    priorities = {"p0": 0, "p1": 1, "p2": 2}
    for i, (rid, priority) in enumerate(priorities.items()):
        scheduler.add_request(request(rid, 12, priority, float(i), max_tokens=12))
    preempted_all = []
    for _ in range(200):
        if not scheduler.num_unfinished:
            break
        _, preempted, _ = step(scheduler)
        running = {r.request_id for r in scheduler.running}
        # whoever is preempted ranks below every request still running
        assert all(priorities[v] >= max(priorities[r] for r in running) for v in preempted if running)
        preempted_all += preempted
    assert preempted_all and "p0" not in preempted_all
    assert kv.num_free_blocks == kv.num_total_blocks


def test_no_room_is_made_for_a_request_that_could_not_be_admitted_anyway():
    """Its adapter has no slot: nothing is preempted for it (each step would otherwise
    preempt the same request, and with a step in flight admit it again at once)."""
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64, max_loras=1, policy="priority")
    a = request("a", 8, 0, 0.0, max_tokens=30)
    a.sampling_params = SamplingParams(max_tokens=30, priority=0, lora_name="x")
    scheduler.add_request(a)
    scheduler.add_request(request("v", 8, 5, 1.0, max_tokens=30))
    step(scheduler)
    h = request("h", 8, 1, 2.0, max_tokens=4)
    h.sampling_params = SamplingParams(max_tokens=4, priority=1, lora_name="y")
    scheduler.add_request(h)
    for _ in range(5):
        assert step(scheduler)[1] == []
    assert scheduler.num_preemptions == 0


def test_room_counts_the_prefix_cache_hits():
    """A waiting request whose prompt is mostly cached needs only its new blocks: with
    those free, nobody is preempted for it."""
    kv = KVCacheManager(num_blocks=20, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=128, policy="priority")
    shared = list(range(10, 42))                                     # 8 full blocks
    a = request("a", 1, 0, 0.0, max_tokens=50)
    a.prompt_token_ids = list(shared)
    scheduler.add_request(a)
    scheduler.add_request(request("v", 32, 5, 1.0, max_tokens=50))
    step(scheduler)
    step(scheduler)                     # ("v"'s prompt sat the first step out: "a"'s first token)
    h = request("h", 1, 1, 2.0, max_tokens=4)
    h.prompt_token_ids = shared + [50, 51, 52, 53]
    scheduler.add_request(h)
    scheduled, preempted, _ = step(scheduler)
    assert preempted == [] and "h" in scheduled and "v" in scheduled


def test_lower_prompts_sit_out_the_steps_of_a_better_ranked_first_token():
    """"high" arrives while "low"'s long prompt is being computed: neither its admission
    step (the running batch's lower prompts are visited after admission) nor the next
    (its first token still in flight under async scheduling: two schedules before an
    update) carries any of "low"'s prompt, "dec"'s decode both; once the token is in,
    "low" goes on. FCFS lets "low" take the step budget and "high" wait."""
    for policy in ("priority", "fcfs"):
        kv = KVCacheManager(num_blocks=128, block_size=4, enable_prefix_caching=False)
        scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, policy=policy)
        scheduler.add_request(request("dec", 2, 5, 0.0, max_tokens=30))
        step(scheduler)
        scheduler.add_request(request("low", 300, 5, 1.0, max_tokens=4))
        assert step(scheduler)[0] == ["dec", "low"]                 # "low"'s first chunk
        scheduler.add_request(request("high", 6, 0, 2.0, max_tokens=4))
        in_flight = [scheduler.schedule()]
        in_flight.append(scheduler.schedule())                    # its first token not back yet
        shares = [{s.request.request_id: s.num_new_tokens for s in out.scheduled} for out in in_flight]
        if policy == "fcfs":
            assert shares == [{"dec": 1, "low": 63}, {"dec": 1, "low": 63}]
        else:
            assert shares == [{"dec": 1, "high": 6}, {"dec": 1, "high": 1}]
        for out in in_flight:
            scheduler.update_from_output(out, ModelRunnerOutput([[7] if s.completes_prompt else []
                                                                 for s in out.scheduled]))
        assert "low" in step(scheduler)[0]
        run_to_end(scheduler, kv)


def test_a_deferred_prompt_runs_when_the_head_is_not_admitted():
    """"low"'s running prompt is visited after admission for "h", which outranks it, but
    "h"'s adapter has no slot while "a" runs: "low"'s chunk runs in the same step, and
    "w", ranked no better than "low", is not admitted ahead of it."""
    kv = KVCacheManager(num_blocks=128, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_loras=1, policy="priority")
    a = request("a", 2, 5, 0.0, max_tokens=30)
    a.sampling_params = SamplingParams(max_tokens=30, priority=5, lora_name="x")
    scheduler.add_request(a)
    step(scheduler)
    scheduler.add_request(request("low", 300, 5, 1.0, max_tokens=4))
    assert step(scheduler)[0] == ["a", "low"]
    h = request("h", 8, 0, 2.0, max_tokens=4)
    h.sampling_params = SamplingParams(max_tokens=4, priority=0, lora_name="y")
    scheduler.add_request(h)
    scheduler.add_request(request("w", 8, 5, 3.0, max_tokens=4))
    out = scheduler.schedule()
    assert {s.request.request_id: s.num_new_tokens for s in out.scheduled} == {"a": 1, "low": 63}
    scheduler.update_from_output(out, ModelRunnerOutput([[] for _ in out.scheduled]))
    run_to_end(scheduler, kv)


def test_a_waiting_head_that_cannot_run_holds_no_prompt_back():
    """"h" outranks "v" but its adapter has no slot while "a" runs: "v"'s prompt does not
    sit out for it (only for "a"'s first token)."""
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_loras=1, policy="priority")
    a = request("a", 8, 0, 0.0, max_tokens=30)
    a.sampling_params = SamplingParams(max_tokens=30, priority=0, lora_name="x")
    scheduler.add_request(a)
    h = request("h", 8, 1, 1.0, max_tokens=4)
    h.sampling_params = SamplingParams(max_tokens=4, priority=1, lora_name="y")
    scheduler.add_request(h)
    scheduler.add_request(request("v", 8, 5, 2.0, max_tokens=4))
    assert step(scheduler)[0] == ["a"]
    assert step(scheduler)[0] == ["a", "v"]
    run_to_end(scheduler, kv)


def test_lower_prompts_get_their_allowance_while_better_ranked_work_is_present():
    """lower_priority_prefill_tokens=8: "low"'s prompt chunks are at most 8 tokens while
    "high" runs, and whole again once it has finished; without the cap, one chunk."""
    def low_chunks(cap):
        kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
        scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, policy="priority",
                              lower_priority_prefill_tokens=cap)
        scheduler.add_request(request("high", 2, 0, 0.0, max_tokens=4))
        scheduler.add_request(request("low", 60, 5, 1.0, max_tokens=2))
        chunks = []
        while scheduler.num_unfinished:
            high_present = "high" in scheduler.requests
            out = scheduler.schedule()
            chunks += [(s.num_new_tokens, high_present) for s in out.scheduled
                       if s.request.request_id == "low" and s.num_new_tokens > 1]
            scheduler.update_from_output(out, ModelRunnerOutput([[7] if s.completes_prompt else []
                                                                 for s in out.scheduled]))
        assert kv.num_free_blocks == kv.num_total_blocks
        return chunks
    assert low_chunks(None) == [(60, True)]
    assert low_chunks(8) == [(8, True), (8, True), (8, True), (36, False)]


def test_the_allowance_is_for_the_priority_policy():
    with pytest.raises(ValueError, match="lower_priority_prefill_tokens needs scheduling_policy 'priority'"):
        EngineArgs(model="x", lower_priority_prefill_tokens=128)
    assert EngineArgs(model="x", scheduling_policy="priority",
                      lower_priority_prefill_tokens=128).lower_priority_prefill_tokens == 128


def test_a_waiting_head_whose_cached_prefix_leaves_no_room_stalls_nothing():
    """(A review's reproduction of a stall in the first version, which counted a waiting
    head as the lead when it seemed to fit: its evictable prefix hits made the pool look
    roomier than it was, its allocation failed, and the lower prompt sat out every step
    for good.) Every request completes and the pool ends free."""
    kv = KVCacheManager(num_blocks=20, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16, policy="priority")
    shared = list(range(100, 132))                  # 8 full blocks, cached and then free
    first = request("P", 1, 0, 0.0, max_tokens=1)
    first.prompt_token_ids = shared + [5]
    scheduler.add_request(first)
    run_to_end(scheduler, kv)
    scheduler.add_request(request("L", 64, 5, 1.0, max_tokens=4))
    for _ in range(3):
        step(scheduler)
    high = request("H", 1, 0, 2.0)
    high.prompt_token_ids = shared + list(range(300, 320))
    scheduler.add_request(high)
    assert set(run_to_end(scheduler, kv)) == {"L", "H"}
