"""backend/triton_server/stop_key.py: a `stop` ends only requests sent with its key."""

import json

import pytest

from backend.engine.errors import InvalidRequestError
from backend.triton_server.request_parser import parse_request
from backend.triton_server.stop_key import MAX_STOP_KEY_CHARS, may_stop, required_stop_key, stop_key_of

import numpy as np


def test_the_key_is_read_from_the_request_parameters():
    assert stop_key_of(json.dumps({"stop_key": "s3cret", "temperature": 0})) == "s3cret"
    assert stop_key_of("") is None and stop_key_of("{}") is None and stop_key_of("not json") is None


@pytest.mark.parametrize("value", [1, "", None, ["k"], "k" * (MAX_STOP_KEY_CHARS + 1)])
def test_a_malformed_key_is_a_clear_error(value):
    with pytest.raises(InvalidRequestError, match="stop_key"):
        stop_key_of(json.dumps({"stop_key": value}))


def test_a_stop_must_carry_a_key():
    with pytest.raises(InvalidRequestError, match="stop_key.*cancelling its own stream"):
        required_stop_key(json.dumps({"temperature": 0}))


def test_only_the_same_key_may_stop():
    assert may_stop("k1", "k1")
    assert not may_stop("k1", "k2")
    assert not may_stop(None, "k1")   # sent without a key: no stop by id reaches it


def test_the_key_is_not_a_sampling_parameter():
    """Request parameters double as sampling parameters (the vLLM backend's way): the key
    is taken out of them, and kept whichever carries the sampling parameters."""
    inputs = {"text_input": np.array([b"hi"], dtype=object)}
    parsed = parse_request(inputs, request_parameters=json.dumps({"stop_key": "k", "max_tokens": 3}))
    assert parsed.stop_key == "k" and parsed.params.max_tokens == 3
    inputs["sampling_parameters"] = np.array([json.dumps({"max_tokens": 4}).encode()], dtype=object)
    parsed = parse_request(inputs, request_parameters=json.dumps({"stop_key": "k"}))
    assert parsed.stop_key == "k" and parsed.params.max_tokens == 4
    assert parse_request(inputs).stop_key is None
