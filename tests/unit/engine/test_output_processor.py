"""The output side alone (no model, no scheduler): text, stop strings and logprob text
from EngineCoreOutputs, and the one call back (the ids of the requests a stop string
ended)."""

import pytest

from backend.engine.sampling.logprobs import Logprob
from backend.engine.output_processor import OutputProcessor
from backend.engine.outputs import EngineCoreOutput
from backend.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_ckpt)


def test_token_ids_and_finish_reason_pass_through_without_a_tokenizer():
    outputs = OutputProcessor(None)
    outputs.add("r", [3, 4], SamplingParams())
    (first,), stopped = outputs.process([EngineCoreOutput("r", [5, 6], num_cached_tokens=0)])
    assert first.new_token_ids == [5, 6] and not first.finished and stopped == []
    (last,), stopped = outputs.process([EngineCoreOutput("r", [7], finish_reason="length")])
    assert last.finished and last.finish_reason == "length" and last.token_ids == [5, 6, 7]
    assert stopped == [] and "r" not in outputs
    assert outputs.process([EngineCoreOutput("r", [8])]) == ([], [])    # forgotten: dropped


def test_a_stop_string_inside_the_accepted_tokens_ends_the_request_there(tokenizer):
    ids = tokenizer.encode("one two three four five six")
    stop_at = next(i for i in range(2, len(ids)) if "three" in tokenizer.decode(ids[1:i + 1]))
    outputs = OutputProcessor(tokenizer)
    outputs.add("r", ids[:1], SamplingParams(stop=["three"]))
    (out,), stopped = outputs.process([EngineCoreOutput("r", ids[1:])])
    assert out.finished and out.finish_reason == "stop" and stopped == ["r"]
    assert out.token_ids == ids[1:stop_at + 1]               # the tokens after the stop are dropped
    assert out.text == tokenizer.decode(ids[1:stop_at + 1]).split("three")[0]


def test_an_engine_finish_is_not_sent_back(tokenizer):
    ids = tokenizer.encode("one two three")
    outputs = OutputProcessor(tokenizer)
    outputs.add("r", ids[:1], SamplingParams(stop=["three"]))
    (out,), stopped = outputs.process([EngineCoreOutput("r", ids[1:], finish_reason="length")])
    assert out.finished and out.finish_reason == "stop" and stopped == []   # the text's stop names it


def test_min_tokens_defers_stop_strings_and_logprobs_get_text(tokenizer):
    ids = tokenizer.encode("one one one one")
    outputs = OutputProcessor(tokenizer)
    outputs.add("r", ids[:1], SamplingParams(stop=["one"], min_tokens=len(ids), logprobs=1))
    outs = []
    for t in ids[1:]:
        outs += outputs.process([EngineCoreOutput("r", [t], [{t: Logprob(-0.5, 1)}])])[0]
    assert not any(o.finished for o in outs)
    text = "".join(o.new_logprobs[0][t].decoded_token for o, t in zip(outs, ids[1:]))
    assert text == tokenizer.decode(ids[1:])                # the rank-1 texts spell the output
    assert outs[-1].cumulative_logprob == -0.5 * len(outs)
    final = outputs.final_output("r", "abort")
    assert final.finish_reason == "abort" and len(final.logprobs) == len(outs) and "r" not in outputs
