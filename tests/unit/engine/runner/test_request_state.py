"""The runner's request states (backend/engine/runner/request_state.py) as the other
tensor- and pipeline-parallel ranks keep them: rank 0's journal, sent through the real
payload codec (backend/parallel/step_payload.py) and replayed into states of another
`RequestStates`, gives a second StepInputBuilder the same step inputs as rank 0's, step
after step, through chunked prefill, preemption, prefix hits, proposals, finished
requests and a request id used again. No processes here: the TP/PP exactness tests
(tests/unit/parallel/) run the same path across real ranks."""

import numpy as np
import pytest
import torch

from backend.engine.request import Request
from backend.engine.runner.model_runner import ModelRunner
from backend.engine.runner.request_state import RequestStates
from backend.engine.runner.step_inputs import StepInputBuilder
from backend.engine.sampling.sampler import Sampler
from backend.engine.scheduling.kv_cache_manager import KVCacheManager
from backend.engine.scheduling.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from backend.engine.scheduling.scheduler import Scheduler
from backend.engine.spec_decode.proposals import Proposals
from backend.parallel import step_payload
from backend.parallel.step_payload import RankStep
from backend.sampling_params import SamplingParams
from tests.unit.engine.runner.test_model_runner import BLOCK, VOCAB, NextTokenModel

CPU = torch.device("cpu")


class OtherRank:
    """Stands in for TensorParallelWorkers and a rank behind it: each step's journal goes
    through the payload codec, is replayed into this rank's own states and built by its
    own builder; the inputs it built are kept."""

    def __init__(self) -> None:
        self.states = RequestStates(CPU)
        self.inputs = StepInputBuilder(64, 8, 16, BLOCK, CPU)
        self.built: list[dict] = []
        self.payload_bytes: list[int] = []
        self.same_digest: list[bool] = []

    def send_step(self, journal, inputs_digest, graph=None, lora_ids=None) -> None:
        payload = step_payload.encode(RankStep(journal, lora_ids))
        self.payload_bytes.append(int(payload.shape[0]))
        out, states = self.states.replay(step_payload.decode(payload).journal)
        self.built.append(inputs_of(self.inputs.build(out, states)))
        self.same_digest.append(self.inputs.digest() == inputs_digest)


def inputs_of(step) -> dict:
    """What the forward reads, as host arrays (a later build rewrites the buffers)."""
    meta = step.meta
    return {"input_ids": step.input_ids.numpy().copy(), "positions": step.positions.numpy().copy(),
            "slot_mapping": meta.slot_mapping.numpy().copy(), "seq_lens": meta.seq_lens.numpy().copy(),
            "query_start_loc": meta.query_start_loc.numpy().copy(),
            "block_tables": meta.block_tables.numpy().copy(), "logits_indices": step.logits_indices.numpy().copy()}


def request(rid: str, prompt: list[int], max_tokens: int = 6) -> Request:
    p = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0)
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=p, arrival_time=0.0,
                   max_tokens=max_tokens)


def test_a_rank_replaying_the_journal_builds_rank_0s_inputs_every_step():
    # 9 blocks of 4 tokens: not enough for every request at once (preemption); a 10-token
    # budget cuts prompts into chunks; "c" repeats "a"'s prompt (prefix hits).
    kv = KVCacheManager(num_blocks=9, block_size=BLOCK, enable_prefix_caching=True)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=10)
    rank = OtherRank()
    runner = ModelRunner(NextTokenModel(), [], BLOCK, CPU, Sampler(0, CPU, 8), StepInputBuilder(64, 8, 16, BLOCK, CPU),
                         VOCAB, workers=rank)
    mine: list[dict] = []
    build = runner.inputs.build
    runner.inputs.build = lambda out, states, pad_to=None: (lambda s: (mine.append(inputs_of(s)), s)[1])(
        build(out, states, pad_to))
    prompts = {"a": list(range(1, 13)), "b": list(range(20, 27)), "c": list(range(1, 13)), "d": [40, 41, 42]}
    for rid, prompt in prompts.items():
        scheduler.add_request(request(rid, prompt))
    reused = False
    for step in range(200):
        if not scheduler.num_unfinished:
            if reused:
                break
            scheduler.add_request(request("a", [50, 51, 52, 53, 54], max_tokens=3))      # an id used again
            reused = True
        if step == 6:   # proposals (as n-gram's) for whoever decodes: verification rows, rollbacks
            decoding = [r for r in scheduler.running if r.num_output_tokens > 0]
            scheduler.set_proposals(Proposals({r.request_id: ([r.output_token_ids[-1] + 1, 0], None)
                                               for r in decoding}))
        out = scheduler.schedule()
        if out.is_empty:
            runner.update_states(out)
            continue
        scheduler.update_from_output(out, runner.execute(out))
    assert not scheduler.num_unfinished and reused
    assert scheduler.num_preemptions > 0
    assert len(rank.built) == len(mine) > 10 and all(rank.same_digest)
    for i, (got, want) in enumerate(zip(rank.built, mine)):
        for name in want:
            assert np.array_equal(got[name], want[name]), f"step {i}: {name} differs"
    # The last finished ids reach rank 0's runner in an empty step, and wait in the
    # journal for the next step sent; with it, the rank drops every request too.
    runner.update_states(scheduler.schedule())
    assert len(runner.states) == 0 and len(rank.states) > 0
    rank.states.replay(runner.states.take_journal() + [SchedulerOutput().for_ranks()])
    assert len(rank.states) == 0
    print(f"{len(mine)} steps; payload {min(rank.payload_bytes)}-{max(rank.payload_bytes)} bytes")


def test_a_journal_that_does_not_end_with_a_step_is_refused():
    states = RequestStates(CPU)
    with pytest.raises(RuntimeError, match="must end with the step"):
        states.replay([])


def test_a_rank_whose_states_drifted_has_another_digest():
    """What rank.py checks each step: a rank that missed a sampled token builds other
    input ids, and its digest of them differs from rank 0's."""
    rank0 = RequestStates(CPU, journal=True)
    builders = [StepInputBuilder(64, 8, 16, BLOCK, CPU) for _ in range(3)]
    ranks = [RequestStates(CPU), RequestStates(CPU)]            # one in step, one that drifts
    first = SchedulerOutput([ScheduledRequest(None, 3, request_id="a", block_ids_start=0, new_block_ids=[5])],
                            [NewRequestData("a", [1, 2, 3], [], None, 8, frozenset(), None, None, None, False, False, 0)])
    states = rank0.apply(first)
    builders[0].build(first, states)
    journal = rank0.take_journal()
    for rank, builder in zip(ranks, builders[1:]):
        builder.build(*rank.replay(journal))
        assert builder.digest() == builders[0].digest()
    rank0.append(states, [[9]])                                 # the first step sampled 9
    second = SchedulerOutput([ScheduledRequest(None, 1, request_id="a", num_computed_tokens=3)])
    builders[0].build(second, rank0.apply(second))
    journal = rank0.take_journal()
    assert journal[0] == [("a", [9])]
    builders[1].build(*ranks[0].replay(journal))
    builders[2].build(*ranks[1].replay(journal[1:]))            # the token never arrived
    assert builders[1].digest() == builders[0].digest() != builders[2].digest()
