"""The model runner alone, over steps a real scheduler makes and over typed steps built by
hand (no scheduler, no Request: its own state from NewRequestData), with a stand-in model whose
next token after t is always t + 1 (no weights): which rows it samples (none for a prompt
chunk that stops short of the prompt's end), what it returns per scheduled request, the
verification of proposals (accepted up to the first miss, then the model's own token),
logprobs for the requests that asked, and that it never writes request state. Exactness
with real models: test_exactness.py; async scheduling: test_async_scheduling.py."""

import math

import torch

from backend.engine.scheduling.kv_cache_manager import KVCacheManager
from backend.engine.runner.model_runner import ModelRunner
from backend.engine.request import Request
from backend.engine.sampling.sampler import Sampler
from backend.engine.scheduling.scheduler import Scheduler
from backend.engine.spec_decode.proposals import Proposals
from backend.engine.runner.step_inputs import StepInputBuilder
from backend.sampling_params import SamplingParams

VOCAB = 64
BLOCK = 4
MARGIN = 8.0            # the next token's logit above every other token's 0


class NextTokenModel:
    """Logits that put the token after each input token (t + 1 mod VOCAB) MARGIN above
    the rest. The hidden state is the input id itself."""
    calls = 0

    def __call__(self, input_ids, positions, kv_caches, meta):
        NextTokenModel.calls += 1
        return input_ids.to(torch.float32)[:, None]

    def compute_logits(self, hidden):
        ids = hidden[:, 0].long()
        logits = torch.zeros(ids.shape[0], VOCAB)
        logits[torch.arange(ids.shape[0]), (ids + 1) % VOCAB] = MARGIN
        return logits


def setup(budget: int = 16) -> tuple[Scheduler, ModelRunner]:
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=budget)
    cpu = torch.device("cpu")
    runner = ModelRunner(NextTokenModel(), [], BLOCK, cpu, Sampler(0, cpu, 8),
                         StepInputBuilder(64, 8, 16, BLOCK, cpu), VOCAB)
    return scheduler, runner


def request(rid: str, prompt: list[int], **params) -> Request:
    p = SamplingParams(max_tokens=8, temperature=0, **params)
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=p, arrival_time=0.0, max_tokens=8)


def snapshot(r: Request) -> tuple:
    return (list(r.output_token_ids), r.num_computed_tokens, list(r.spec_token_ids), r.status)


def test_a_prompt_chunk_samples_nothing_and_the_last_chunk_samples_the_next_token():
    scheduler, runner = setup(budget=12)
    a, b = request("a", [5, 6, 7]), request("b", list(range(20, 30)))
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [3, 9]        # b's prompt is cut short
    before = [snapshot(a), snapshot(b)]
    result = runner.execute(out)
    assert result.sampled_token_ids == [[8], []]
    assert [snapshot(a), snapshot(b)] == before                        # the runner writes no request state
    scheduler.update_from_output(out, result)
    out = scheduler.schedule()                                         # a decodes; b's last prompt token
    assert runner.execute(out).sampled_token_ids == [[9], [30]]


def test_proposals_are_accepted_up_to_the_first_miss_then_the_model_token():
    scheduler, runner = setup()
    a, b = request("a", [10, 11]), request("b", [40])
    for r in (a, b):
        scheduler.add_request(r)
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner.execute(out))             # a: 12, b: 41
    assert (a.output_token_ids, b.output_token_ids) == ([12], [41])
    # a's first two proposals are the model's next tokens, its third is not; b's first misses.
    scheduler.set_proposals(Proposals(tokens={"a": ([13, 14, 99], None), "b": ([7, 43], None)}))
    out = scheduler.schedule()
    assert [list(s.spec_token_ids) for s in out.scheduled] == [[13, 14, 99], [7, 43]]
    result = runner.execute(out)
    assert result.sampled_token_ids == [[13, 14, 15], [42]]


def test_logprobs_for_the_requests_that_asked_only():
    scheduler, runner = setup()
    a, b = request("a", [3], logprobs=2), request("b", [30])
    for r in (a, b):
        scheduler.add_request(r)
    out = scheduler.schedule()
    result = runner.execute(out)
    assert result.sampled_token_ids == [[4], [31]]
    assert list(result.logprobs) == [0]                                # by index in the schedule
    entry = result.logprobs[0]
    assert list(entry)[0] == 4 and entry[4].rank == 1
    # log-softmax of one logit MARGIN above VOCAB - 1 zeros
    want = MARGIN - math.log(math.exp(MARGIN) + VOCAB - 1)
    assert abs(entry[4].logprob - want) < 1e-5
    # the top 2, the sampled token (the top one) among them
    assert len(entry) == 2 and sorted(e.rank for e in entry.values()) == [1, 2]


def test_a_step_with_no_sampled_row_runs_the_model_and_samples_nothing():
    scheduler, runner = setup(budget=4)
    scheduler.add_request(request("a", list(range(10))))
    out = scheduler.schedule()
    calls = NextTokenModel.calls
    assert runner.execute(out).sampled_token_ids == [[]]
    assert NextTokenModel.calls == calls + 1


# ------------------------------------------------------------- typed steps alone
def typed_runner() -> ModelRunner:
    cpu = torch.device("cpu")
    return ModelRunner(NextTokenModel(), [], BLOCK, cpu, Sampler(0, cpu, 8),
                       StepInputBuilder(64, 8, 16, BLOCK, cpu), VOCAB)


def new(rid: str, prompt: list[int], output=(), computed: int = 0, resumed: bool = False, **params):
    from backend.engine.scheduling.sched_output import NewRequestData
    p = SamplingParams(max_tokens=8, temperature=0, **params)
    return NewRequestData(rid, prompt, list(output), p, 8, frozenset(), None, None, None, False, False, computed,
                          resumed)


def share(rid: str, num_new: int, computed: int, completes: bool = True, spec=(), blocks=(0, None)):
    """A request's share of a typed step; `blocks`: its block table's diff (start, ids)."""
    from backend.engine.scheduling.sched_output import ScheduledRequest
    return ScheduledRequest(None, num_new, list(spec), request_id=rid, num_computed_tokens=computed,
                            completes_prompt=completes, block_ids_start=blocks[0], new_block_ids=blocks[1])


def test_the_runner_runs_on_typed_steps_alone_and_keeps_its_own_state():
    """No scheduler and no Request: a request arrives as NewRequestData, decodes from the
    tokens the runner sampled itself, verifies proposals, pauses when preempted, resumes
    with what it had, and is dropped once finished."""
    from backend.engine.scheduling.sched_output import SchedulerOutput
    runner = typed_runner()
    step = SchedulerOutput([share("a", 3, 0, blocks=(0, [0, 1, 2])), share("b", 2, 0, completes=False,
                                                                              blocks=(0, [3, 4]))],
                           [new("a", [5, 6, 7]), new("b", [20, 21, 22])])
    assert runner.execute(step).sampled_token_ids == [[8], []]      # b's prompt is cut short
    a, b = runner.states.get("a"), runner.states.get("b")
    assert a.output_token_ids == [8] and b.output_token_ids == []
    # a decodes its own sampled token; b's last prompt token samples its first.
    assert runner.execute(SchedulerOutput([share("a", 1, 3), share("b", 1, 2)])).sampled_token_ids == [[9], [23]]
    assert a.output_token_ids == [8, 9] and b.output_token_ids == [23]
    # a verifies proposals 10 (right) and 12 (wrong: the model says 11): one accepted.
    assert runner.execute(SchedulerOutput([share("a", 3, 4, spec=[10, 12])])).sampled_token_ids == [[10, 11]]
    assert a.output_token_ids == [8, 9, 10, 11]
    # b is preempted: paused, its tokens kept; resumed, it recomputes from them.
    runner.execute(SchedulerOutput([share("a", 1, 6)], preempted_req_ids=["b"]))
    assert not b.running and runner.states.get("b") is b and b.block_ids == []     # (its blocks are gone)
    out = runner.execute(SchedulerOutput([share("b", 4, 0, blocks=(0, [5, 6]))],
                                         [new("b", [20, 21, 22], [23], resumed=True)]))
    assert out.sampled_token_ids == [[24]] and b.running and b.output_token_ids == [23, 24]
    assert b.block_ids == [5, 6] and a.block_ids == [0, 1, 2]
    # a finished: its state is let go of with the next step.
    runner.execute(SchedulerOutput([share("b", 1, 4)], finished_req_ids=["a"]))
    assert "a" not in runner.states and not a.running and len(runner.states) == 1


def test_a_step_of_a_request_never_sent_is_refused_by_name():
    import pytest

    from backend.engine.scheduling.sched_output import SchedulerOutput
    runner = typed_runner()
    with pytest.raises(RuntimeError, match="request 'x' was scheduled but never sent"):
        runner.execute(SchedulerOutput([share("x", 1, 0)]))
