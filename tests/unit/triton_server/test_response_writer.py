"""The llm model's responses carry only the outputs their request asked for: Python
backend 24.10's sender drops the others itself, freeing them without the GIL (a heap
corrupted under load). Against tests/helpers/fake_pb_utils.py."""

import pytest

from backend.engine.outputs import RequestOutput
from backend.sampling_params import SamplingParams
from backend.triton_server.request_parser import ParsedRequest

ALL = ["text_output", "output_ids", "finish_reason", "cumulative_logprob", "logprobs", "prompt_logprobs",
       "num_input_tokens", "num_output_tokens"]


def respond(stub, requested, stream):
    parsed = ParsedRequest(prompt=[1, 2], params=SamplingParams(max_tokens=2), stream=stream,
                           return_finish_reason=True, return_num_output_tokens=True, return_num_input_tokens=True)
    writer = stub.modules["response_writer"].ResponseWriter("r#0", sender=None, parsed=parsed, arrival=0.0,
                                                             child_ids=["r#0"], requested_outputs=requested)
    responses = [writer.on_output(0, RequestOutput("r#0", [5], "a", finished=False, num_prompt_tokens=2)),
                 writer.on_output(0, RequestOutput("r#0", [6], "b", finished=True, finish_reason="length",
                                                   num_prompt_tokens=2))]
    return [{t.name(): t.as_numpy() for t in r[0].output_tensors()} for r in responses if r is not None]


@pytest.mark.parametrize("stream", [False, True])
def test_only_the_outputs_asked_for(stub, stream):
    sent = respond(stub, ["text_output"], stream)
    assert sent and all(set(r) == {"text_output"} for r in sent)
    assert [bytes(r["text_output"][0]) for r in sent] == ([b"a", b"b"] if stream else [b"ab"])


def test_every_output_when_all_are_asked_for(stub):
    """Triton asks for all of a model's outputs when the client names none."""
    (last,) = respond(stub, ALL, stream=False)
    assert set(last) == {"text_output", "output_ids", "finish_reason", "num_input_tokens", "num_output_tokens"}
    assert list(last["output_ids"]) == [5, 6] and list(last["num_output_tokens"]) == [2]
