"""The scheduler alone (scheduler.py, and step_results.py: its write of a step's result),
against a fake runner's output (no model): the step's token budget
and max_num_seqs, chunked prefill, preemption when the KV pool runs out (the newest
request goes back to the front of the queue and recomputes), stops on max_tokens and
EOS, aborts, and on random workloads the invariants of every step, with the pool free at
the end. Exactness with a model: test_exactness.py."""

import random

import pytest

from backend.engine.scheduling.kv_cache_manager import KVCacheManager
from backend.engine.outputs import ModelRunnerOutput
from backend.engine.request import Request, RequestStatus
from backend.engine.scheduling.scheduler import Scheduler
from backend.sampling_params import SamplingParams

EOS = 2


def request(rid: str, prompt_len: int, max_tokens: int = 4, first: int = 10) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(range(first, first + prompt_len)),
                   sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=False), arrival_time=0.0,
                   max_tokens=max_tokens, eos_token_ids=frozenset({EOS}))


def fake_run(out, token=lambda s: 7) -> ModelRunnerOutput:
    """One token for each row whose step completes its prompt (or decodes), none for a
    prompt chunk: what the runner returns."""
    return ModelRunnerOutput([[token(s)] if s.completes_prompt else [] for s in out.scheduled])


def setup(num_blocks: int = 32, block_size: int = 4, max_num_seqs: int = 4, budget: int = 16,
          prefix_caching: bool = False) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget), kv


def run_to_end(scheduler: Scheduler, kv: KVCacheManager, steps: int = 200) -> dict[str, list]:
    """Steps until nothing is left; each request's outputs, and the pool free after."""
    seen: dict[str, list] = {}
    for _ in range(steps):
        if not scheduler.num_unfinished:
            break
        out = scheduler.schedule()
        for o in scheduler.update_from_output(out, fake_run(out)):
            seen.setdefault(o.request_id, []).append(o)
    assert not scheduler.num_unfinished and not scheduler.running and not scheduler.waiting
    assert kv.num_free_blocks == kv.num_total_blocks
    return seen


def test_prompts_share_the_budget_and_the_last_one_is_chunked():
    scheduler, kv = setup(budget=12)
    a, b = request("a", 10), request("b", 10)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 10), ("b", 2)]
    assert out.num_tokens == 12 and scheduler.num_chunked_prefills == 1
    outputs = scheduler.update_from_output(out, fake_run(out))
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("a", [7])]   # b's chunk samples nothing
    out = scheduler.schedule()
    # a decodes (1 token), b's prompt goes on where its chunk ended.
    assert [(s.request.request_id, s.num_new_tokens, s.num_computed_tokens) for s in out.scheduled] == [
        ("a", 1, 10), ("b", 8, 2)]
    scheduler.update_from_output(out, fake_run(out))
    assert b.num_output_tokens == 1 and a.num_output_tokens == 2
    run_to_end(scheduler, kv)


def test_max_num_seqs_caps_the_running_requests():
    scheduler, kv = setup(max_num_seqs=2, budget=64)
    for i in range(3):
        scheduler.add_request(request(f"r{i}", 4))
    out = scheduler.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"] and len(scheduler.waiting) == 1
    scheduler.update_from_output(out, fake_run(out))
    run_to_end(scheduler, kv)


def test_max_tokens_and_eos_finish_and_free_the_blocks():
    scheduler, kv = setup()
    long, short = request("long", 5, max_tokens=3), request("eos", 5, max_tokens=10)
    scheduler.add_request(long)
    scheduler.add_request(short)
    tokens = {"long": iter([5, 6, 7]), "eos": iter([5, EOS])}
    finished = {}
    while scheduler.num_unfinished:
        out = scheduler.schedule()
        result = fake_run(out, token=lambda s: next(tokens[s.request.request_id]))
        for o in scheduler.update_from_output(out, result):
            if o.finish_reason:
                finished[o.request_id] = o.finish_reason
                assert kv.block_table(o.request_id) == []          # freed at once
    assert finished == {"long": "length", "eos": "stop"}
    assert long.output_token_ids == [5, 6, 7] and short.output_token_ids == [5, EOS]
    assert kv.num_free_blocks == kv.num_total_blocks


def test_an_abort_frees_its_blocks_and_the_others_go_on():
    scheduler, kv = setup()
    a, b = request("a", 6, max_tokens=5), request("b", 6, max_tokens=5)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    assert scheduler.abort_request("a") is a
    # Its row's result arrives after the abort: ignored.
    assert [o.request_id for o in scheduler.update_from_output(out, fake_run(out))] == ["b"]
    assert a.is_finished and kv.block_table("a") == [] and scheduler.running == [b]
    assert scheduler.abort_request("a") is None                     # once only
    seen = run_to_end(scheduler, kv)
    assert sum(len(o.new_token_ids) for o in seen["b"]) == 4 and "a" not in seen


def test_a_full_pool_preempts_the_newest_request_which_recomputes():
    # 6 blocks of 4 tokens: two 8-token prompts take 4; decoding past 12 tokens each needs 8.
    scheduler, kv = setup(num_blocks=6, budget=32)
    old, new = request("old", 8, max_tokens=8), request("new", 8, max_tokens=8, first=50)
    scheduler.add_request(old)
    scheduler.add_request(new)
    preempted = []
    while not preempted:
        out = scheduler.schedule()
        preempted = out.preempted
        scheduler.update_from_output(out, fake_run(out))
    assert preempted == [new] and new.status == RequestStatus.WAITING and new.num_preemptions == 1
    assert scheduler.waiting[0] is new and new.num_computed_tokens == 0 and kv.block_table("new") == []
    assert scheduler.num_preemptions == 1 and old.status == RequestStatus.RUNNING
    kept = list(new.output_token_ids)
    seen = run_to_end(scheduler, kv)
    assert new.output_token_ids[:len(kept)] == kept and new.num_output_tokens == 8 and old.num_output_tokens == 8
    assert sum(len(o.new_token_ids) for o in seen["new"]) == 8 - len(kept)


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_keep_every_step_within_its_limits(seed):
    """Random prompts, lengths, budgets and pool sizes; every step: within the token budget
    and max_num_seqs, each scheduled request holding the slots for its tokens, no request
    both scheduled and preempted; at the end every request got exactly max_tokens tokens
    (no EOS is drawn) and the pool is free."""
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    scheduler, kv = setup(num_blocks=rng.randint(12, 40), block_size=block_size, max_num_seqs=rng.randint(1, 6),
                          budget=rng.randint(8, 48), prefix_caching=rng.random() < 0.5)
    capacity = (kv.num_total_blocks - 1) * block_size
    requests = []
    for i in range(rng.randint(3, 12)):
        prompt_len = rng.randint(1, min(30, capacity // 2))
        r = request(f"r{i}", prompt_len, max_tokens=rng.randint(1, min(10, capacity - prompt_len)),
                    first=10 + rng.choice([0, 0, 100 * i]))                 # some share a prefix
        requests.append(r)
        scheduler.add_request(r)
    for _ in range(2000):
        if not scheduler.num_unfinished:
            break
        out = scheduler.schedule()
        assert out.num_tokens <= scheduler.max_num_batched_tokens
        assert len(out.scheduled) <= scheduler.max_num_seqs and len(scheduler.running) <= scheduler.max_num_seqs
        ids = [s.request.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids)) and not set(ids) & {r.request_id for r in out.preempted}
        for s in out.scheduled:
            slots = len(kv.block_table(s.request.request_id)) * block_size
            assert slots >= s.num_computed_tokens + s.num_new_tokens, (s.request.request_id, slots)
        scheduler.update_from_output(out, fake_run(out, token=lambda s: rng.randint(3, 99)))
    assert not scheduler.num_unfinished, "did not finish"
    assert all(r.num_output_tokens == r.max_tokens and r.finish_reason.value == "length" for r in requests)
    assert kv.num_free_blocks == kv.num_total_blocks
