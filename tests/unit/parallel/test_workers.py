"""The control messages rank 0 sends the other ranks (backend/parallel/messages.py):
typed, and encoded to and from the fixed-width header without loss; and a step's payload
(backend/parallel/step_payload.py), which holds only what a step may hold."""

import pickle

import pytest
import torch

from backend.engine.runner.step_inputs import GraphShape
from backend.engine.scheduling.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from backend.parallel import step_payload
from backend.parallel.messages import (HEADER_LEN, CaptureMessage, SetupMessage, StepMessage, StopMessage, decode,
                                       encode)
from backend.parallel.step_payload import RankStep


@pytest.mark.parametrize("message", [
    StopMessage(),
    SetupMessage(num_kv_blocks=300, block_size=16, max_tokens=520, max_seqs=8, max_blocks_per_seq=64),
    CaptureMessage(max_num_seqs=8, max_model_len=1024),
    CaptureMessage(max_num_seqs=8, max_model_len=1024, verify_query_len=4),
    StepMessage.of(1234, 0xFFFFFFFF, graph=None),
    StepMessage.of(77, 0, graph=GraphShape(4)),
    StepMessage.of(5, 12345, graph=GraphShape(8, 3)),
])
def test_messages_round_trip_through_the_header(message):
    header = encode(message)
    assert header.shape == (HEADER_LEN,)
    assert decode(header) == message
    if isinstance(message, StepMessage):
        assert decode(header).graph == (message.graph if message.graph_num_seqs else None)


def test_a_step_payload_round_trips():
    new = NewRequestData("a", [1, 2, 3], [], None, 8, frozenset({2}), None, None, None, False, False, 0)
    step = SchedulerOutput([ScheduledRequest(None, 3, request_id="a", block_ids_start=0, new_block_ids=[4])], [new],
                           finished_req_ids=["z"], other_block_diffs={"b": (1, [9])})
    journal = [[("b", [7, 8])], step.for_ranks()]
    got = step_payload.decode(step_payload.encode(RankStep(journal, lora_ids=[-1])))
    assert got.journal == journal and got.lora_ids == [-1]
    expanded = got.journal[-1].step()
    assert expanded.scheduled == step.scheduled and expanded.new_requests == [new]
    assert (expanded.finished_req_ids, expanded.other_block_diffs) == (["z"], {"b": (1, [9])})


def test_a_payload_naming_another_class_is_refused():
    """Reading a payload makes only the step's own classes: a pickle that would call
    anything else (here os.system) is refused before it runs."""
    class Evil:
        def __reduce__(self):
            import os
            return (os.system, ("true",))

    payload = torch.frombuffer(bytearray(pickle.dumps(([Evil()], None))), dtype=torch.uint8)
    with pytest.raises(pickle.UnpicklingError, match="may not hold"):
        step_payload.decode(payload)


def test_every_field_of_a_scheduled_request_reaches_the_ranks_or_is_named_rank_0s():
    """A new ScheduledRequest field is either sent to the other ranks (_RANK_FIELDS) or
    named here as rank 0's own bookkeeping: it cannot silently take its default there."""
    import dataclasses
    from backend.engine.scheduling import sched_output
    rank_0_only = {"request", "draft_probs", "num_rejected"}
    fields = {f.name for f in dataclasses.fields(ScheduledRequest)}
    assert fields == set(sched_output._RANK_FIELDS) | rank_0_only
