"""backend/parallel/messages.py: the control messages rank 0 broadcasts, as one fixed-width
int64 header each."""

import pytest
import torch

from backend.engine.runner.step_inputs import GraphShape
from backend.parallel.messages import (HEADER_LEN, CaptureMessage, SetupMessage, StageTimesMessage, StepMessage,
                                       StopMessage, decode, encode)

EVERY_KIND = [StopMessage(), SetupMessage(1024, 16, 2048, 256, 64), CaptureMessage(256, 4096, 5),
              StageTimesMessage(1), StepMessage(12345, 2**40 + 7, 16, 1)]


@pytest.mark.parametrize("message", EVERY_KIND, ids=lambda m: type(m).__name__)
def test_every_kind_round_trips_through_one_fixed_width_header(message):
    header = encode(message)
    assert header.dtype == torch.int64 and header.shape == (HEADER_LEN,)
    assert decode(header) == message


def test_the_header_fits_the_widest_message_and_a_digest_keeps_its_64_bits():
    assert HEADER_LEN == 1 + max(len(m.values()) for m in EVERY_KIND)
    digest = 2**63 - 1
    assert decode(encode(StepMessage(1, digest))).inputs_digest == digest


def test_a_step_carries_its_cuda_graph_shape_or_none_for_eager():
    eager = StepMessage.of(10, 3, None)
    assert eager.graph is None and decode(encode(eager)).graph is None
    graphed = StepMessage.of(10, 3, GraphShape(32, 1))
    assert decode(encode(graphed)).graph == GraphShape(32, 1)


def test_defaults_fill_what_an_older_sender_left_out():
    # A header's unused tail is zeros: a CaptureMessage without a verify length decodes to 0.
    assert decode(encode(CaptureMessage(8, 512))) == CaptureMessage(8, 512, 0)
