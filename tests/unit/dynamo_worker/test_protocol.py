"""backend/dynamo_worker/protocol.py: Dynamo's PreprocessedRequest into our
SamplingParams, and our outputs into its response chunks (no Dynamo needed)."""

import pytest

from backend.dynamo_worker.protocol import BadRequest, chunk_from, sampling_params_from
from backend.engine.outputs import RequestOutput
from backend.engine.sampling.logprobs import Logprob


def request(**parts):
    return {"token_ids": [5, 6, 7], **parts}


def test_sampling_options_stop_conditions_and_output_options_map_to_ours():
    params = sampling_params_from(request(
        sampling_options={"temperature": 0.5, "top_p": 0.9, "top_k": 4, "seed": 3, "presence_penalty": 0.1,
                          "frequency_penalty": None, "guided_decoding": {"regex": "[ab]+"}},
        stop_conditions={"max_tokens": 7, "ignore_eos": True, "stop": ["no"],
                         "stop_token_ids_hidden": [2, 9]},
        output_options={"logprobs": 2, "prompt_logprobs": None}), max_model_len=64)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.5, 0.9, 4, 3)
    assert (params.presence_penalty, params.frequency_penalty) == (0.1, 0.0)
    assert params.guided_regex == "[ab]+"
    assert (params.max_tokens, params.ignore_eos) == (7, True)
    assert sampling_params_from(request(stop_conditions={"min_tokens": 2}), max_model_len=64).min_tokens == 2
    # Stop strings stay with Dynamo (it detokenizes); the ids it hides end the request here.
    assert params.stop == [] and params.stop_token_ids == [2, 9]
    assert params.logprobs == 2 and params.prompt_logprobs is None


def test_without_max_tokens_a_request_may_run_to_the_end_of_the_context():
    assert sampling_params_from(request(), max_model_len=64).max_tokens == 61


@pytest.mark.parametrize("bad, field", [
    (request(sampling_options={"temperature": -1}), "temperature"),
    (request(stop_conditions={"max_tokens": 0}), "max_tokens"),
    ({"token_ids": []}, "token_ids"),
    ({}, "token_ids"),
])
def test_a_bad_request_names_its_field(bad, field):
    with pytest.raises(BadRequest, match=field):
        sampling_params_from(bad, max_model_len=64)


def output(**fields):
    return RequestOutput(**{"request_id": "r", "new_token_ids": [], "new_text": "", "finished": False, **fields})


def test_chunks_carry_new_tokens_and_the_last_one_its_reason_and_usage():
    assert chunk_from(output(), 0) is None
    assert chunk_from(output(new_token_ids=[4, 5]), 2) == {"index": 0, "token_ids": [4, 5]}
    last = chunk_from(output(new_token_ids=[6], finished=True, finish_reason="length", num_prompt_tokens=3,
                             num_cached_tokens=2), 3)
    assert last == {"index": 0, "token_ids": [6], "finish_reason": "length",
                    "completion_usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                                         "prompt_tokens_details": {"cached_tokens": 2}}}
    assert chunk_from(output(finished=True, finish_reason="abort"), 0)["finish_reason"] == "cancelled"
    failed = chunk_from(output(finished=True, finish_reason="error", error=ValueError("prompt too long")), 0)
    assert failed["finish_reason"] == "error: prompt too long"


def test_logprobs_go_as_dynamo_reads_them():
    entry = {7: Logprob(-0.5, 2, "a"), 8: Logprob(-0.1, 1, "b")}       # the sampled token first
    chunk = chunk_from(output(new_token_ids=[7], new_logprobs=[entry]), 1)
    assert chunk["log_probs"] == [-0.5]
    assert chunk["top_logprobs"] == [[{"rank": 2, "token_id": 7, "token": "a", "logprob": -0.5},
                                      {"rank": 1, "token_id": 8, "token": "b", "logprob": -0.1}]]
