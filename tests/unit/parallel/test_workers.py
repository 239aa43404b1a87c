"""The control messages rank 0 sends the tensor-parallel ranks (backend/parallel/messages.py):
typed, and encoded to and from the fixed-width header without loss."""

import pytest

from backend.engine.runner.step_inputs import GraphShape, StepInputBuilder
from backend.parallel.messages import (HEADER_LEN, CaptureMessage, SetupMessage, StepMessage, StopMessage, decode,
                                       encode)

PLAN = tuple(range(10, 10 + StepInputBuilder.PLAN_LEN))


@pytest.mark.parametrize("message", [
    StopMessage(),
    SetupMessage(num_kv_blocks=300, block_size=16, max_tokens=520, max_seqs=8, max_blocks_per_seq=64),
    CaptureMessage(max_num_seqs=8, max_model_len=1024),
    CaptureMessage(max_num_seqs=8, max_model_len=1024, verify_query_len=4),
    StepMessage(PLAN, graph=None),
    StepMessage(PLAN, graph=GraphShape(4), with_lora=True),
    StepMessage(PLAN, graph=GraphShape(8, 3)),
])
def test_messages_round_trip_through_the_header(message):
    header = encode(message)
    assert header.shape == (HEADER_LEN,)
    assert decode(header) == message


def test_the_header_fits_the_widest_message_and_plans_have_their_length():
    assert HEADER_LEN == 1 + StepInputBuilder.PLAN_LEN + 3          # plan, graph rows and tokens per row, LoRA
    with pytest.raises(AssertionError):
        StepMessage(PLAN[:-1], graph=None)
