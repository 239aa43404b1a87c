"""vLLM-backend contract details and per-token logprobs through the session's real tritonserver (supervised, as `make
serve`), in the vLLM backend's contract: inputs `return_logprobs` and
`return_cumulative_logprob`, outputs `logprobs` (JSON: per token {id: {logprob, rank,
decoded_token}}, only the new tokens' on each streamed response; null when the sampling
parameter `logprobs` was not set) and `cumulative_logprob`."""

import numpy as np
import pytest

from backend import LLM, SamplingParams
from clients.triton_client import StreamingRequest
from tests.integration.conftest import wait_blocks_free

PROMPT = "The yield statement"
FLAGS = {"return_logprobs": np.array([True]), "return_cumulative_logprob": np.array([True])}


@pytest.fixture(scope="module")
def offline(tiny_ckpt):
    llm = LLM(tiny_ckpt, block_size=16, num_kv_blocks=64)
    return llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, logprobs=2, ignore_eos=True))[0]


def as_offline(entries):
    return [{int(t): (round(d["logprob"], 4), d["rank"], d["decoded_token"]) for t, d in e.items()}
            for e in entries]


@pytest.mark.parametrize("stream", [True, False])
def test_logprobs_equal_offline(server, offline, stream):
    params = {"max_tokens": 8, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    res = StreamingRequest(server.grpc_url).run(PROMPT, params, stream=stream, extra=FLAGS)
    assert res.ok, res.error
    assert res.token_ids == offline.token_ids
    if stream:  # one token per response, each with its own entry only
        assert all(len(entries) == 1 for entries in res.logprobs)
    got = [e for entries in res.logprobs for e in entries]
    want = [{t: (round(lp.logprob, 4), lp.rank, lp.decoded_token) for t, lp in e.items()} for e in offline.logprobs]
    assert as_offline(got) == want
    assert res.cumulative_logprobs[-1] == pytest.approx(offline.cumulative_logprob, abs=1e-4)
    if stream:
        assert len(set(res.cumulative_logprobs)) == len(res.cumulative_logprobs)  # changes every token
    wait_blocks_free(server)


def test_cumulative_without_logprobs_says_null(server, offline):
    """As the vLLM backend: cumulative_logprob is sent, logprobs is null without the
    sampling parameter."""
    params = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    res = StreamingRequest(server.grpc_url).run(PROMPT, params, extra=FLAGS)
    assert res.ok and res.logprobs and all(entries is None for entries in res.logprobs)
    assert res.cumulative_logprobs[-1] == pytest.approx(offline.cumulative_logprob, abs=1e-4)
    plain = StreamingRequest(server.grpc_url).run(PROMPT, params)
    assert plain.ok and not plain.logprobs and not plain.cumulative_logprobs
    wait_blocks_free(server)


def test_too_many_logprobs_is_a_clear_error(server):
    res = StreamingRequest(server.grpc_url).run(PROMPT, {"max_tokens": 2, "logprobs": 21}, extra=FLAGS)
    assert res.error and "logprobs" in res.error
    wait_blocks_free(server)


def test_streamed_rank_one_tokens_spell_the_text(server):
    """The vLLM backend's own consistency check: each streamed response's rank-1
    `decoded_token`s are its `text_output`; finish_reason is "None" until the last."""
    res = StreamingRequest(server.grpc_url).run(PROMPT, {"max_tokens": 12, "temperature": 0, "logprobs": 2,
                                                         "ignore_eos": True}, extra=FLAGS)
    assert res.ok and len(res.pieces) == 12
    for piece, entries in zip(res.pieces, res.logprobs):
        assert piece == "".join(d["decoded_token"] for e in entries for d in e.values() if d["rank"] == 1)
    assert res.finish_reasons == ["None"] * 11 + ["length"]
    wait_blocks_free(server)


def test_request_parameters_stand_in_for_the_tensor(server):
    """Sampling parameters sent as Triton request parameters, no tensor: honoured."""
    res = StreamingRequest(server.grpc_url).run(PROMPT, None, parameters={"max_tokens": 3, "temperature": 0})
    assert res.ok and len(res.token_ids) == 3
    bad = StreamingRequest(server.grpc_url).run(PROMPT, None, parameters={"max_tokens": 3, "best_of": 2})
    assert bad.error and "best_of" in bad.error
    wait_blocks_free(server)
