"""Persistent block tables (backend/engine/runner/step_inputs.py): over random steps (blocks
allocated, proposals' blocks trimmed and others allocated in their place, requests
freed, preempted and re-admitted with prefix hits, rows in any order, padded steps),
the runner's copies of the tables, kept by the typed steps' diffs alone, and every
step's block tables and slot mapping on the device are what the KV cache manager holds;
a step sends only the entries that changed; and a second rank that replays the runner's
journal of typed steps (tensor parallelism: backend/parallel/rank.py) builds the same
tables."""

import random

import torch

from backend.engine.scheduling.kv_cache_manager import KVCacheManager
from backend.engine.request import Request
from backend.engine.runner.request_state import RequestStates
from backend.engine.scheduling.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from backend.engine.runner.step_inputs import GraphShape, StepInputBuilder
from backend.sampling_params import SamplingParams

BS, B, M = 4, 6, 16


def _request(rid: str, n: int, rng: random.Random) -> Request:
    r = Request(request_id=rid, prompt_token_ids=[rng.randrange(3, 9) for _ in range(n)],
                sampling_params=SamplingParams(), arrival_time=0.0, max_tokens=100)
    return r


def _step(held: RequestStates, kv: KVCacheManager, sched: list[ScheduledRequest], finished=(), preempted=()):
    """The typed step the scheduler would send (its diffs taken from `kv`), applied to the
    runner's states `held`: (the step, the scheduled requests' states)."""
    new = []
    for s in sched:
        state = held.get(s.request.request_id)
        if state is None or not state.running or s.request.request_id in preempted:
            new.append(NewRequestData.of(s.request, resumed=state is not None))
    out = SchedulerOutput(sched, new, finished_req_ids=list(finished), preempted_req_ids=list(preempted))
    kv.set_block_diffs(out)
    return out, held.apply(out)


def _check_step(builder: StepInputBuilder, step, sched: list[ScheduledRequest], kv: KVCacheManager,
                states) -> None:
    for s, state in zip(sched, states):             # the runner's copies
        assert state.block_ids == kv.block_table(s.request.request_id)
    tables = step.meta.block_tables.cpu().numpy()
    slots = step.meta.slot_mapping.cpu().numpy()
    assert step.meta.block_tables.data_ptr() == builder.step_tables.data_ptr()      # fixed address
    token = 0
    for i, s in enumerate(sched):
        ids = kv.block_table(s.request.request_id)
        assert tables[i, :len(ids)].tolist() == list(ids), f"row {i}"
        for pos in range(s.request.num_computed_tokens, s.request.num_computed_tokens + s.num_new_tokens):
            assert slots[token] == ids[pos // BS] * BS + pos % BS
            token += 1
    assert (builder.step_tables[len(sched):step.meta.block_tables.shape[0]] == 0).all()   # padding rows


def test_tables_follow_the_kv_cache_manager_over_random_steps():
    rng = random.Random(0)
    kv = KVCacheManager(60, BS, enable_prefix_caching=True)
    rank0 = StepInputBuilder(256, B, M, BS, torch.device("cpu"))
    rank1 = StepInputBuilder(256, B, M, BS, torch.device("cpu"))
    live: list[Request] = []
    waiting: list[Request] = []
    held = RequestStates(torch.device("cpu"), journal=True)
    held1 = RequestStates(torch.device("cpu"))         # rank 1's, from rank 0's journal
    finished: list[str] = []
    preempted: list[str] = []
    n = 0
    sent_total = 0
    for step_no in range(300):
        # Admit (new, or a preempted request back with its prefix hits).
        while len(live) < B and rng.random() < 0.5:
            if waiting and rng.random() < 0.5:
                r = waiting.pop(0)
            else:
                n += 1
                r = _request(f"r{n}", rng.randrange(1, 20), rng)
            cached = kv.find_cached_blocks(r)
            if cached is None:                  # its prefix is computed in this step
                waiting.insert(0, r)
                break
            if not kv.allocate_slots(r, r.num_tokens - len(cached) * BS, cached):
                kv.free(r)
                break
            r.num_computed_tokens = len(cached) * BS
            live.append(r)
        if not live:
            continue
        rng.shuffle(live)
        sched = []
        for r in live:
            if r.num_computed_tokens == r.num_tokens and rng.random() < 0.2:
                continue                                    # sits the step out (a step in flight)
            if r.num_computed_tokens == r.num_tokens:        # decoding: the last sampled token
                r.prompt_token_ids.append(rng.randrange(3, 9))
                if not kv.allocate_slots(r, 1):
                    continue
            sched.append(ScheduledRequest(r, r.num_tokens - r.num_computed_tokens))
        if not sched:
            continue
        pad = rng.choice([None, len(sched), B]) if all(s.num_new_tokens == 1 for s in sched) else None
        out, states = _step(held, kv, sched, finished, preempted)
        finished, preempted = [], []
        step = rank0.build(out, states, pad_to=GraphShape(pad) if pad else None)
        _check_step(rank0, step, sched, kv, states)
        for r in live:          # the requests outside the step too (a trim while not scheduled)
            assert held.get(r.request_id).block_ids == kv.block_table(r.request_id)
        sent_total += rank0.num_table_updates
        other = rank1.build(*held1.replay(held.take_journal()), pad_to=GraphShape(pad) if pad else None)
        assert torch.equal(other.meta.block_tables, step.meta.block_tables)
        assert torch.equal(other.meta.slot_mapping, step.meta.slot_mapping)
        assert torch.equal(rank1.table_device, rank0.table_device)
        for s in sched:
            s.request.num_computed_tokens += s.num_new_tokens
            kv.cache_computed_blocks(s.request)
        for r in list(live):
            event = rng.random()
            if event < 0.25 and r.num_tokens > 1:           # proposals' blocks, then rolled back
                k = rng.randrange(1, 9)
                if kv.allocate_slots(r, k):
                    kv.trim(r, r.num_tokens + rng.randrange(0, k))
            elif event < 0.32:                              # finished
                live.remove(r)
                kv.free(r)
                finished.append(r.request_id)
            elif event < 0.38:                              # preempted
                live.remove(r)
                kv.free(r)
                r.num_computed_tokens = 0
                waiting.append(r)
                preempted.append(r.request_id)
            if r.num_tokens > 40 and r in live:             # keep within max_blocks_per_seq
                live.remove(r)
                kv.free(r)
                finished.append(r.request_id)
    assert n > 30 and sent_total > 0


def test_a_decode_step_sends_only_new_block_ids():
    rng = random.Random(1)
    kv = KVCacheManager(200, BS, enable_prefix_caching=False)
    builder = StepInputBuilder(64, B, 40, BS, torch.device("cpu"))
    requests = [_request(f"r{i}", 100, rng) for i in range(B)]
    for r in requests:
        assert kv.allocate_slots(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens - 1
    held = RequestStates(torch.device("cpu"))
    sent, diffs = [], []
    for _ in range(8):
        sched = [ScheduledRequest(r, 1) for r in requests]
        out, states = _step(held, kv, sched)
        step = builder.build(out, states)
        _check_step(builder, step, sched, kv, states)
        sent.append(builder.num_table_updates)
        diffs.append(sum(len(s.new_block_ids or []) for s in sched))
        for r in requests:
            r.num_computed_tokens += 1
            r.prompt_token_ids.append(5)
            assert kv.allocate_slots(r, 1)
    # First step: every row (25 blocks each); then a new block per request every 4 tokens,
    # in the typed step as on the device.
    assert sent == diffs == [B * 25, B, 0, 0, 0, B, 0, 0]


def test_a_trimmed_table_is_rewritten_from_the_first_changed_entry():
    """Blocks given back after rejected proposals and others appended in their place: the
    step's diff starts at the first replaced entry, and so does the device's update."""
    rng = random.Random(2)
    kv = KVCacheManager(20, BS, enable_prefix_caching=False)
    builder = StepInputBuilder(16, 2, 6, BS, torch.device("cpu"))
    held = RequestStates(torch.device("cpu"))
    r = _request("a", 6, rng)
    assert kv.allocate_slots(r, 6 + 5)                # the prompt and 5 proposals' slots: 3 blocks
    r.num_computed_tokens = 5
    sched = [ScheduledRequest(r, 1)]
    out, states = _step(held, kv, sched)
    first = list(kv.block_table("a"))
    assert (sched[0].block_ids_start, sched[0].new_block_ids) == (0, first) and len(first) == 3
    builder.build(out, states)
    r.num_computed_tokens = 6
    kv.trim(r, 6)                                     # the proposals' last block back
    assert kv.allocate_slots(r, 6)                    # 12 tokens: a third block again
    sched = [ScheduledRequest(r, 1)]
    out, states = _step(held, kv, sched)
    table = kv.block_table("a")
    assert (sched[0].block_ids_start, sched[0].new_block_ids) == (2, table[2:])     # (whatever its id)
    step = builder.build(out, states)
    assert builder.num_table_updates == 1             # one entry sent
    _check_step(builder, step, sched, kv, states)
    assert step.meta.slot_mapping.tolist() == [table[1] * BS + 2]
