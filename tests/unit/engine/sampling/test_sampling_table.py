"""The sampler's persistent parameter table (backend/engine/sampling/sampling_table.py):
each distinct settings row written once, gathered by slot every step, slots reused (the one
written longest ago first) but never one the step uses, the table grown when a step needs it."""

import random

import torch

from backend.engine.sampling.sampler import NUM_COLUMNS, Sampler
from backend.engine.sampling.sampling_table import SamplingTable
from backend.sampling_params import SamplingParams
from tests.unit.engine.sampling.test_sampler import req


def step(table: SamplingTable, rows: list[tuple]) -> torch.Tensor:
    """One step's gather, as the sampler does it."""
    slots = table.slots(rows)
    table.write_pending(torch.tensor(table.pending_slots(), dtype=torch.int64))
    return table.gather(torch.tensor(slots, dtype=torch.int64), len(rows))


def params(k: int) -> tuple:
    return tuple(float(k + c) for c in range(NUM_COLUMNS))


def test_random_steps_gather_each_rows_own_settings():
    rng = random.Random(0)
    table = SamplingTable(NUM_COLUMNS, torch.device("cpu"), capacity=4)
    writes = 0
    for _ in range(300):
        rows = [params(rng.randrange(12)) for _ in range(rng.randint(0, 9))]
        got = step(table, rows)
        writes += len(table.written)
        assert got.shape == (len(rows), NUM_COLUMNS)
        if rows:
            assert torch.equal(got, torch.tensor(rows, dtype=torch.float32))
    assert table.capacity >= 8 and writes < 300 * 4     # grown past a step's distinct rows; rows reused


def test_a_row_is_written_once_and_shared():
    table = SamplingTable(NUM_COLUMNS, torch.device("cpu"), capacity=4)
    step(table, [params(1), params(1), params(2)])
    assert len(table.written) == 2
    step(table, [params(2), params(1)])
    assert table.written == []


def test_a_slot_the_step_uses_is_never_taken_back():
    table = SamplingTable(NUM_COLUMNS, torch.device("cpu"), capacity=2)
    step(table, [params(0), params(1)])
    got = step(table, [params(0), params(2)])                  # full: params(1)'s slot, idle, goes
    assert table.capacity == 2 and torch.equal(got, torch.tensor([params(0), params(2)], dtype=torch.float32))
    got = step(table, [params(0), params(2), params(3)])       # both slots in use: it grows
    assert table.capacity == 4
    assert torch.equal(got, torch.tensor([params(0), params(2), params(3)], dtype=torch.float32))
    step(table, [params(1)])
    assert len(table.written) == 1                             # (written again: it had gone)


def test_the_sampler_uploads_only_settings_it_has_not_seen():
    s = Sampler(device=torch.device("cpu"))
    requests = [req(SamplingParams(), prompt=(1, 2)), req(SamplingParams(temperature=0.7, top_p=0.9), prompt=(3,)),
                req(SamplingParams(), prompt=(4,))]
    first = s.prepare(requests, 32)
    assert len(s.rows.written) == 2                             # two distinct settings
    second = s.prepare(requests[::-1], 32)
    assert s.rows.written == []
    assert torch.equal(second.params, first.params.flip(0))


def test_rows_of_a_call_that_failed_before_its_upload_are_written_again():
    table = SamplingTable(NUM_COLUMNS, torch.device("cpu"), capacity=4)
    table.slots([params(1)])                                   # (the step failed: nothing written)
    got = step(table, [params(1)])
    assert len(table.written) == 1 and torch.equal(got, torch.tensor([params(1)], dtype=torch.float32))
