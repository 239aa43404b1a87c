"""Penalties from per-request token state kept across steps (backend/engine/sampling/penalty_state.py)
give exactly what recomputing them from every request's whole prompt and output gives:
on random data with outputs growing, shrinking and replaced, requests finishing and slots
recycled, tables growing, verification rows; and in the engine through preemption and
speculative rollbacks."""

import random

import pytest
import torch

from backend import LLM, SamplingParams
from backend.engine.sampling.penalty_state import PenaltyState
from backend.engine.runner.request_state import RequestState
from backend.engine.sampling.sampler import Sampler
from backend.engine.spec_decode.rejection_sampler import VerifyRow
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.per_row_sampler import processed_logits

V = 40
PARAMS = [
    SamplingParams(temperature=0, repetition_penalty=1.7),
    SamplingParams(temperature=0.8, frequency_penalty=0.6),
    SamplingParams(temperature=0, presence_penalty=0.9),
    SamplingParams(temperature=1.1, repetition_penalty=0.7, frequency_penalty=-0.4, presence_penalty=0.3),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=0, min_tokens=3, frequency_penalty=0.2, stop_token_ids=[4]),
]


def _request(rng: random.Random, i: int) -> RequestState:
    r = RequestState(request_id=f"r{i}", prompt_token_ids=[rng.randrange(V) for _ in range(rng.randrange(1, 12))],
                sampling_params=rng.choice(PARAMS), max_tokens=100,
                eos_token_ids=frozenset([1]))
    r.output_token_ids = [rng.randrange(V) for _ in range(rng.randrange(0, 4))]
    return r


def _check(sampler: Sampler, rows: list, logits: torch.Tensor) -> None:
    penalized, _ = sampler.distributions(logits, sampler.prepare(rows, V))
    for i, row in enumerate(rows):
        expected = processed_logits(logits[i], row)          # the full recompute, per row
        assert torch.equal(penalized[i], expected), f"row {i}: {row.sampling_params}"


def test_state_matches_full_recompute_on_random_steps():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler(0)
    sampler.penalties = PenaltyState(torch.device("cpu"), initial_slots=2, max_slots=6)   # grow and evict
    live = [_request(rng, i) for i in range(10)]
    next_id = 10
    for step in range(60):
        batch = rng.sample(live, rng.randrange(1, len(live) + 1))
        rows = []
        for r in batch:                                       # some verify proposals
            spec = [rng.randrange(V) for _ in range(rng.choice([0, 0, 1, 3]))]
            rows += [VerifyRow(r, spec[:j]) if j else r for j in range(len(spec) + 1)]
        _check(sampler, rows, torch.randn(len(rows), V, generator=gen) * 3)
        for r in live:
            event = rng.random()
            if event < 0.6:                                   # tokens accepted since the last step
                r.output_token_ids.extend(rng.randrange(V) for _ in range(rng.choice([1, 1, 2, 4])))
            elif event < 0.65 and r.output_token_ids:         # an output shrank
                del r.output_token_ids[-rng.randrange(1, len(r.output_token_ids) + 1):]
            elif event < 0.7:                                 # the list was replaced
                r.output_token_ids = list(r.output_token_ids) + [rng.randrange(V)]
        if rng.random() < 0.3:                                # one finishes, another arrives
            gone = live.pop(rng.randrange(len(live)))
            gone.running = False
            live.append(_request(rng, next_id))
            next_id += 1
    assert sampler.penalties.capacity > 3                     # the tables grew
    assert sampler.penalties.num_slots_in_use <= sampler.penalties.capacity - 1


def test_a_step_sends_only_new_tokens():
    rng = random.Random(1)
    sampler = Sampler(0)
    r = RequestState(request_id="r", prompt_token_ids=[rng.randrange(V) for _ in range(500)],
                sampling_params=SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5), max_tokens=100)
    r.output_token_ids = [3] * 200
    sampler.prepare([r], V)
    for step in range(3):
        r.output_token_ids.append(step)
        sampler.prepare([r], V)
        seen, counted = sampler.penalties._seen_updates, sampler.penalties._count_updates
        assert [len(t) for _, t in seen] == [1] and [len(t) for _, t in counted] == [1]
    assert sampler.penalties.counts[1].sum() == 203


def test_verification_rows_leave_no_trace():
    """Proposals count for their verification rows only: a rejected proposal is never
    in the request's state, whatever the next step holds."""
    sampler = Sampler(0)
    r = RequestState(request_id="r", prompt_token_ids=[5], sampling_params=SamplingParams(
        temperature=0, frequency_penalty=1.0, repetition_penalty=2.0), max_tokens=10)
    r.output_token_ids = [7]
    logits = torch.ones(3, V)
    _check(sampler, [r, VerifyRow(r, [8]), VerifyRow(r, [8, 9])], logits)
    r.output_token_ids.append(6)                     # proposal 8 rejected; the target said 6
    _check(sampler, [r], logits[:1])
    assert sampler.penalties.counts[1, 8] == 0 and not sampler.penalties.seen[1, 8]


def _full_recompute(monkeypatch) -> None:
    """Every prepare starts from empty state: the old per-step recomputation."""
    real = Sampler.prepare

    def prepare(self, requests, vocab_size):
        self.penalties.reset()
        return real(self, requests, vocab_size)
    monkeypatch.setattr(Sampler, "prepare", prepare)


PENALIZED = [SamplingParams(max_tokens=14, min_tokens=14, temperature=0, repetition_penalty=1.6,
                            frequency_penalty=0.7, presence_penalty=0.4),
             SamplingParams(max_tokens=14, min_tokens=14, temperature=0.9, seed=5, frequency_penalty=1.5),
             SamplingParams(max_tokens=14, min_tokens=14, temperature=0, repetition_penalty=0.6)]


def _generate(path, monkeypatch, full: bool, **engine):
    with monkeypatch.context() as m:
        if full:
            _full_recompute(m)
        llm = LLM(path, **engine)
        prompts = random_prompts(9, [30, 5, 17, 40], seed=2)
        outs = llm.generate(prompts, [PENALIZED[i % 3] for i in range(9)])
        assert_pool_free(llm)
        return [o.token_ids for o in outs], llm.stats()


def test_engine_with_preemption_equals_full_recompute(llama_ckpt, monkeypatch):
    engine = dict(block_size=4, num_kv_blocks=40, max_num_seqs=9, max_num_batched_tokens=48, dtype="float32")
    kept, stats = _generate(llama_ckpt, monkeypatch, False, **engine)
    assert stats["num_preemptions"] > 0
    full, _ = _generate(llama_ckpt, monkeypatch, True, **engine)
    assert kept == full


def test_engine_with_speculative_rollbacks_equals_full_recompute(llama_ckpt, monkeypatch):
    engine = dict(block_size=4, num_kv_blocks=200, max_num_seqs=9, max_num_batched_tokens=64, dtype="float32",
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                      "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    kept, stats = _generate(llama_ckpt, monkeypatch, False, **engine)
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0
    full, _ = _generate(llama_ckpt, monkeypatch, True, **engine)
    assert kept == full


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_state_lives_on_the_sampler_device(device):
    sampler = Sampler(0, torch.device(device))
    r = RequestState(request_id="r", prompt_token_ids=[1, 2], sampling_params=SamplingParams(
        repetition_penalty=1.2, presence_penalty=0.1), max_tokens=4)
    r.output_token_ids = [3]
    batch = sampler.prepare([r], V)
    for rows in batch.token_data("penalties"):
        assert rows.slots.device.type == device and rows.table.device.type == device


def test_a_slot_given_out_in_a_call_is_not_reclaimed_in_it():
    """A row of a request that ended while its step was in flight (its state no longer
    running) is still drawn from its slot: a request needing a slot later in the same
    call must get another one, not share it (pipeline micro-batches sample a step after a
    later one was launched)."""
    rng = random.Random(3)
    sampler = Sampler(0)
    sampler.penalties = PenaltyState(torch.device("cpu"), initial_slots=1, max_slots=1)
    gone, new = _request(rng, 0), _request(rng, 1)
    gone.sampling_params = new.sampling_params = PARAMS[0]
    sampler.prepare([gone], V)                                # gone holds the one slot
    gone.running = False                                      # ended since; its row is still drawn
    rows = [gone, new]
    _check(sampler, rows, torch.randn(2, V, generator=torch.Generator().manual_seed(1)) * 3)
    entries = sampler.penalties._entries
    assert entries[id(gone)].slot != entries[id(new)].slot
