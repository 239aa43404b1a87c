"""Per-request limits through the session's real tritonserver (model "llm", the vLLM
backend's contract over gRPC): each limit refuses its request alone with an error that
names the field and the engine argument, and the next request is served; a grammar slow
to compile fails at guided_compile_timeout_s, and a request past its own deadline
(sampling parameter request_timeout_s) is aborted after the tokens it already streamed,
each while another stream goes on and completes with the offline engine's tokens. Every
test ends with the block pool free."""

import json
import os
import re
import threading
import time

import numpy as np
import pytest

from backend import LLM, SamplingParams
from clients.triton_client import StreamingRequest
from tests.integration.conftest import infer, metric, wait_blocks_free, wait_metric

PROMPT = "The while statement"
# Long enough to still be streaming when the other request is sent (after its 3rd token).
CONCURRENT = {"max_tokens": 100, "min_tokens": 100, "temperature": 0}


def vllm_request(sampling: dict) -> dict:
    return {"text_input": np.array([PROMPT.encode()], dtype=object), "stream": np.array([True]),
            "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=object)}


@pytest.fixture(scope="module")
def offline(tiny_ckpt):
    llm = LLM(tiny_ckpt, block_size=16, num_kv_blocks=256)
    return llm.generate([PROMPT], SamplingParams(**CONCURRENT))[0]


@pytest.fixture(scope="module")
def compile_timeout_s(model_repo) -> float:
    """The session server's guided_compile_timeout_s (its config.pbtxt; else the default)."""
    with open(os.path.join(model_repo, "llm", "config.pbtxt")) as f:
        m = re.search(r'key: "guided_compile_timeout_s" value: \{ string_value: "([^"]+)" \}', f.read())
    return float(m.group(1)) if m else 10.0


# (sampling parameters past a default limit, what the error says)
PAST_LIMITS = [
    ({"n": 65}, "sampling parameter 'n' is 65, more than max_n=64 (an engine argument)"),
    ({"logprobs": 21}, "sampling parameter 'logprobs' is 21, more than max_logprobs=20 (an engine argument)"),
    ({"stop": [f"s{i}" for i in range(17)]},
     "sampling parameter 'stop' has 17 strings, more than max_stop_strings=16 (an engine argument)"),
    ({"stop": ["x" * 513]},
     "sampling parameter 'stop' has a string of 513 characters, more than max_stop_string_len=512 "
     "(an engine argument)"),
    ({"stop_token_ids": list(range(65))},
     "sampling parameter 'stop_token_ids' has 65 ids, more than max_stop_token_ids=64 (an engine argument)"),
    ({"guided_regex": "a" * 65537},
     "sampling parameter 'guided_regex' is 65537 bytes, more than max_guided_spec_bytes=65536 (an engine argument)"),
    ({"structured_outputs": {"json": {"enum": ["e" * 65524]}}},
     "sampling parameter 'guided_json' is 65537 bytes, more than max_guided_spec_bytes=65536 (an engine argument)"),
    ({"request_timeout_s": 0}, "sampling parameter 'request_timeout_s'"),
]


def test_each_limit_is_a_clear_error_and_the_next_request_is_served(server):
    for sampling, message in PAST_LIMITS:
        responses, error = infer(server, "llm", vllm_request({**sampling, "max_tokens": 2}))
        assert error is not None and message in error and not responses, (sampling, error)
        responses, error = infer(server, "llm", vllm_request({"max_tokens": 2, "min_tokens": 2}))
        assert error is None and responses, error
    wait_blocks_free(server)


def stream_beside(server, send_other) -> tuple:
    """Streams CONCURRENT; after its 3rd token, runs send_other() (another request, to its
    end). Returns (the stream's result, send_other's result, when it was sent, when it ended)."""
    third, pieces, result = threading.Event(), [], {}

    def on_piece(piece: str) -> None:
        pieces.append(piece)
        if len(pieces) == 3:
            third.set()

    stream = threading.Thread(target=lambda: result.update(
        res=StreamingRequest(server.grpc_url).run(PROMPT, CONCURRENT, on_piece=on_piece)))
    stream.start()
    assert third.wait(60)
    sent = time.perf_counter()
    other = send_other()
    ended = time.perf_counter()
    stream.join(120)
    return result["res"], other, sent, ended


def test_slow_grammar_fails_alone_at_its_compile_limit_while_a_stream_goes_on(server, offline, compile_timeout_s):
    # 60 bytes, seconds to compile in xgrammar 0.2.8 (quadratic in the count): scaled so
    # that it runs well past the server's limit.
    count = int(6000 * max(1.0, compile_timeout_s) ** 0.5)
    schema = {"type": "string", "pattern": f"(a|b){{1,{count}}}"}
    stream, slow, sent, ended = stream_beside(
        server, lambda: StreamingRequest(server.grpc_url).run(PROMPT, {"guided_json": schema, "max_tokens": 8}))
    assert slow.error and (f"sampling parameter 'guided_json' did not compile within guided_compile_timeout_s="
                           f"{compile_timeout_s:g} s (an engine argument)") in slow.error, slow.error
    assert not slow.token_ids
    # The stream got tokens while the grammar compiled, and all of them right.
    assert sum(sent < t < ended for t in stream.times) >= 2, (sent, ended, stream.times)
    assert stream.ok and stream.token_ids == offline.token_ids
    wait_blocks_free(server)


def test_request_past_its_deadline_is_aborted_alone_after_what_it_streamed(server, offline):
    before = metric(server, "llm_requests_rejected_total", 'model="llm",reason="deadline_exceeded"')
    late = {"max_tokens": 1000, "ignore_eos": True, "request_timeout_s": 1.0}
    stream, slow, sent, ended = stream_beside(server, lambda: StreamingRequest(server.grpc_url).run(PROMPT, late))
    assert slow.error and "DEADLINE_EXCEEDED" in slow.error and "exceeded its deadline: request_timeout_s=1 s " \
        "(sampling parameter) after arrival" in slow.error, slow.error
    aborted_after = int(re.search(r"aborted after (\d+) generated tokens", slow.error).group(1))
    assert 0 < len(slow.token_ids) == aborted_after < 1000             # what was streamed stayed delivered
    assert sum(sent < t < ended for t in stream.times) >= 2, (sent, ended, stream.times)
    assert stream.ok and stream.token_ids == offline.token_ids
    wait_blocks_free(server)
    assert wait_metric(server, "llm_requests_rejected_total", before + 1,
                       'model="llm",reason="deadline_exceeded"') == before + 1
