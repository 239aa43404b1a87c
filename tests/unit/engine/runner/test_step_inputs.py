"""Persistent block tables (backend/engine/runner/step_inputs.py): over random steps (blocks
allocated, proposals' blocks trimmed and others allocated in their place, requests
freed, preempted and re-admitted with prefix hits, rows in any order, padded steps),
every step's block tables and slot mapping on the device are what the KV cache manager
holds; a step sends only the entries that changed; and a second rank that applies the
same uploads (tensor parallelism) holds the same tables."""

import random

import numpy as np
import torch

from backend.engine.scheduling.kv_cache_manager import KVCacheManager
from backend.engine.request import Request
from backend.engine.scheduling.sched_output import ScheduledRequest, SchedulerOutput
from backend.engine.runner.step_inputs import GraphShape, StepInputBuilder
from backend.sampling_params import SamplingParams
from tests.helpers.runner_states import states_of

BS, B, M = 4, 6, 16


def _request(rid: str, n: int, rng: random.Random) -> Request:
    r = Request(request_id=rid, prompt_token_ids=[rng.randrange(3, 9) for _ in range(n)],
                sampling_params=SamplingParams(), arrival_time=0.0, max_tokens=100)
    return r


def _check_step(builder: StepInputBuilder, step, sched: list[ScheduledRequest], kv: KVCacheManager) -> None:
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
            if r.num_computed_tokens == r.num_tokens:        # decoding: the last sampled token
                r.prompt_token_ids.append(rng.randrange(3, 9))
                if not kv.allocate_slots(r, 1):
                    continue
            sched.append(ScheduledRequest(r, r.num_tokens - r.num_computed_tokens))
        if not sched:
            continue
        pad = rng.choice([None, len(sched), B]) if all(s.num_new_tokens == 1 for s in sched) else None
        step = rank0.build(SchedulerOutput(sched), states_of(sched), kv.block_table,
                           pad_to=GraphShape(pad) if pad else None)
        _check_step(rank0, step, sched, kv)
        plan = rank0.plan(step)
        sent = (plan[0] - rank0.offsets["table_updates"]) // 2
        sent_total += sent
        rank1.buffer.writable()
        rank1.host_prefix(plan[0]).copy_(rank0.host_prefix(plan[0]))
        other = rank1.rebuild(plan)
        assert torch.equal(other.meta.block_tables, step.meta.block_tables)
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
            elif event < 0.38:                              # preempted
                live.remove(r)
                kv.free(r)
                r.num_computed_tokens = 0
                waiting.append(r)
            if r.num_tokens > 40 and r in live:             # keep within max_blocks_per_seq
                live.remove(r)
                kv.free(r)
    assert n > 30 and sent_total > 0


def test_a_decode_step_sends_only_new_block_ids():
    rng = random.Random(1)
    kv = KVCacheManager(200, BS, enable_prefix_caching=False)
    builder = StepInputBuilder(64, B, 40, BS, torch.device("cpu"))
    requests = [_request(f"r{i}", 100, rng) for i in range(B)]
    for r in requests:
        assert kv.allocate_slots(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens - 1
    sent = []
    for _ in range(8):
        sched = [ScheduledRequest(r, 1) for r in requests]
        step = builder.build(SchedulerOutput(sched), states_of(sched), kv.block_table)
        _check_step(builder, step, sched, kv)
        sent.append((builder.plan(step)[0] - builder.offsets["table_updates"]) // 2)
        for r in requests:
            r.num_computed_tokens += 1
            r.prompt_token_ids.append(5)
            assert kv.allocate_slots(r, 1)
    # First step: every row (25 blocks each); then a new block per request every 4 tokens.
    assert sent == [B * 25, B, 0, 0, 0, B, 0, 0]


def test_plain_lists_are_written_in_full():
    """A block_table_of that returns plain lists (no serials) still gives right tables."""
    builder = StepInputBuilder(16, 2, 4, BS, torch.device("cpu"))
    tables = {"a": [3, 1], "b": [2]}
    rng = random.Random(2)
    reqs = [_request("a", 6, rng), _request("b", 2, rng)]
    for r in reqs:
        r.num_computed_tokens = r.num_tokens - 1
    sched = [ScheduledRequest(r, 1) for r in reqs]
    step = builder.build(SchedulerOutput(sched), states_of(sched), tables.__getitem__)
    assert step.meta.block_tables[0, :2].tolist() == [3, 1] and step.meta.block_tables[1, 0] == 2
    tables["a"] = [0, 2]
    sched = [ScheduledRequest(r, 1) for r in reqs]
    step = builder.build(SchedulerOutput(sched), states_of(sched), tables.__getitem__)
    assert step.meta.block_tables[0, :2].tolist() == [0, 2]
    assert np.array_equal(step.meta.slot_mapping.numpy(), [2 * BS + 1, 2 * BS + 1])
