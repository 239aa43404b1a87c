"""The request parser over plain numpy arrays (no server): contract mapping, and a
hypothesis fuzz test that arbitrary tensors and JSON end in a valid request or a clear
InvalidRequestError, never anything else."""

import json
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from backend import EngineArgs
from backend.engine.errors import InvalidRequestError
from backend.engine.request_limits import RequestLimits
from backend.triton_server.request_parser import INPUT_SPECS, parse_request


def b(x):
    return np.array([x.encode() if isinstance(x, str) else x], dtype=np.object_)


def test_vllm_contract():
    req = parse_request({"text_input": b("hello"), "stream": np.array([True]),
                         "sampling_parameters": b(json.dumps({"max_tokens": "7", "temperature": "0.5",
                                                              "top_p": 0.9, "stop": "END", "ignore_eos": "true"})),
                         "exclude_input_in_output": np.array([True])})
    assert req.prompt == "hello" and req.stream and req.exclude_input_in_output
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.stop, p.ignore_eos) == (7, 0.5, 0.9, ["END"], True)


def test_bad_words_as_the_vllm_backend_takes_them():
    """A list of words, or its JSON text (the vLLM backend's values may be strings)."""
    for value in (["cat", "big dog"], '["cat", "big dog"]'):
        req = parse_request({"text_input": b("x"), "sampling_parameters": b(json.dumps({"bad_words": value}))})
        assert req.params.bad_words == ["cat", "big dog"]
    req = parse_request({"text_input": b("x"), "sampling_parameters": b('{"bad_words_token_ids": [[5], [6, 7]]}')})
    assert req.params.bad_words_token_ids == [[5], [6, 7]]


def test_trtllm_scalars_and_aliases():
    req = parse_request({"text_input": b("x"), "max_tokens": np.array([5], dtype=np.int32),
                         "min_length": np.array([2], dtype=np.int32), "random_seed": np.array([9], dtype=np.uint64),
                         "stop_words": np.array([b"A", b"B"], dtype=np.object_), "end_id": np.array([2], dtype=np.int32)})
    p = req.params
    assert (p.max_tokens, p.min_tokens, p.seed, p.stop, p.stop_token_ids) == (5, 2, 9, ["A", "B"], [2])


def test_defaults():
    req = parse_request({"text_input": b("x")})
    # As the vLLM backend: a single response echoes the prompt unless told not to...
    assert not req.stream and not req.exclude_input_in_output and req.params.max_tokens == 16
    # ...a stream does not, and cannot.
    assert parse_request({"text_input": b("x"), "stream": np.array([True])}).exclude_input_in_output
    with pytest.raises(InvalidRequestError, match="When streaming, `exclude_input_in_output` = False"):
        parse_request({"text_input": b("x"), "stream": np.array([True]),
                       "exclude_input_in_output": np.array([False])})


def test_request_parameters_stand_in_for_the_tensor():
    """As the vLLM backend: sampling parameters sent as Triton request parameters count
    when the `sampling_parameters` tensor is absent; the tensor wins when both are sent."""
    req = parse_request({"text_input": b("x")}, request_parameters='{"max_tokens": 3, "temperature": "0"}')
    assert (req.params.max_tokens, req.params.temperature) == (3, 0.0)
    req = parse_request({"text_input": b("x"), "sampling_parameters": b('{"max_tokens": 5}')},
                        request_parameters='{"max_tokens": 3}')
    assert req.params.max_tokens == 5
    with pytest.raises(InvalidRequestError, match="best_of"):
        parse_request({"text_input": b("x")}, request_parameters='{"best_of": 2}')


def test_input_ids_checked_against_text():
    tokenize = lambda t: [1, 2, 3]  # noqa: E731
    assert parse_request({"text_input": b("x"), "input_ids": np.array([1, 2, 3], dtype=np.int32)}, tokenize).prompt == [1, 2, 3]
    with pytest.raises(InvalidRequestError, match="disagree"):
        parse_request({"text_input": b("x"), "input_ids": np.array([1, 2], dtype=np.int32)}, tokenize)


def test_a_huge_text_beside_input_ids_is_not_tokenized_whole():
    """The red team's gRPC request: 16 MB of text_input with input_ids=[1]. Checking they
    agree tokenized all of it on the execute thread (55 s); now about len(ids) tokens'
    worth, a chunk or two (prompt_length.py)."""
    seen = []

    def tokenize(text):
        seen.append(len(text))
        return [7] * len(text.split())            # a word a token

    text = "word " * (3 << 20)                        # 15 MiB
    with pytest.raises(InvalidRequestError, match="disagree"):
        parse_request({"text_input": b(text), "input_ids": np.array([1], dtype=np.int32)}, tokenize)
    assert sum(seen) <= 2 * 16384
    seen.clear()                                      # ids past max_model_len: no text tokenized at all
    with pytest.raises(InvalidRequestError, match="max_model_len is 1024"):
        parse_request({"text_input": b(text), "input_ids": np.ones(5_000_000, dtype=np.int32)}, tokenize,
                      max_model_len=1024)
    assert seen == []
    assert parse_request({"text_input": b("a b"), "input_ids": np.array([7, 7], dtype=np.int32)}, tokenize).prompt \
        == [7, 7]


def test_the_red_teams_request_costs_the_execute_thread_milliseconds_with_a_real_tokenizer(tiny_ckpt):
    """The same request with the model's own tokenizer (what model.py passes): refused in
    a fraction of a second (it held the execute thread 55 s, so every new request waited),
    and the request behind it is parsed at once. Timing proxies with a wide margin."""
    import time

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    text = "word " * (3 << 20)                        # 15 MiB
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequestError, match="disagree"):
        parse_request({"text_input": b(text), "input_ids": np.array([1], dtype=np.int32)}, tok.encode)
    attack_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert parse_request({"text_input": b("The pass statement")}, tok.encode).prompt == "The pass statement"
    assert attack_s < 1.0 and time.perf_counter() - t0 < 0.5, attack_s


@pytest.mark.parametrize("inputs, match", [
    ({}, "no prompt"),
    ({"text_input": b("")}, "no prompt"),
    ({"text_input": b(b"\xc3\x28")}, "UTF-8"),
    ({"text_input": b("x"), "sampling_parameters": b("{")}, "not valid JSON"),
    ({"text_input": b("x"), "sampling_parameters": b('{"n": 0}')}, "sampling parameter 'n'"),
    ({"text_input": b("x"), "sampling_parameters": b('{"n": 65}')}, "sampling parameter 'n' is 65, more than max_n=64"),
    ({"text_input": b("x"), "sampling_parameters": b('{"logprobs": 21}')},
     "sampling parameter 'logprobs' is 21, more than max_logprobs=20"),
    ({"text_input": b("x"), "sampling_parameters": b('{"request_timeout_s": 0}')}, "'request_timeout_s'"),
    ({"text_input": b("x"), "sampling_parameters": b('{"best_of": 2}')}, "unknown sampling parameter 'best_of'"),
    ({"text_input": b("x"), "sampling_parameters": b('{"max_tokens": -1}')}, "max_tokens"),
    ({"text_input": b("x"), "temperature": np.array([np.inf], dtype=np.float32)}, "temperature"),
    ({"text_input": b("x"), "stream": np.array([1], dtype=np.int32)}, "stream"),
    ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, "exactly one"),
    ({"input_ids": np.array([1.5], dtype=np.float32)}, "input_ids"),
    ({"text_input": b("x"), "sampling_parameters": b('{"bad_words": "cat"}')}, "sampling parameter 'bad_words'"),
    ({"text_input": b("x"), "sampling_parameters": b('{"bad_words": ["cat", " "]}')}, "'bad_words'.*non-empty"),
    ({"text_input": b("x"), "sampling_parameters": b('{"bad_words": [3]}')}, "'bad_words.0'"),
    ({"text_input": b("x"), "sampling_parameters": b(json.dumps({"bad_words": ["w"] * 129}))},
     "'bad_words'.*129 words, more than 128"),
    ({"text_input": b("x"), "sampling_parameters": b('{"bad_words_token_ids": [[]]}')}, "'bad_words_token_ids'"),
])
def test_errors_name_the_input(inputs, match):
    with pytest.raises(InvalidRequestError, match=match):
        parse_request(inputs)


def test_engine_limits_checked_before_n_fans_out():
    """The engine's limits (not the defaults) apply; stop_words count with `stop`."""
    limits = RequestLimits.from_args(EngineArgs.create(model="m", max_n=4, max_stop_strings=2, request_timeout_s=5))
    assert parse_request({"text_input": b("x"), "sampling_parameters": b('{"n": 4}')}, limits=limits).params.n == 4
    with pytest.raises(InvalidRequestError, match="'n' is 5, more than max_n=4"):
        parse_request({"text_input": b("x"), "sampling_parameters": b('{"n": 5}')}, limits=limits)
    with pytest.raises(InvalidRequestError, match="'stop' has 3 strings, more than max_stop_strings=2"):
        parse_request({"text_input": b("x"), "sampling_parameters": b('{"stop": ["a", "b"]}'),
                       "stop_words": np.array([b"c"], dtype=np.object_)}, limits=limits)
    with pytest.raises(InvalidRequestError, match="'request_timeout_s' is 6, more than the engine argument "
                                                  "request_timeout_s=5"):
        parse_request({"text_input": b("x"), "sampling_parameters": b('{"request_timeout_s": "6"}')}, limits=limits)
    with pytest.raises(InvalidRequestError, match="'guided_regex' is 65537 bytes, more than max_guided_spec_bytes"):
        parse_request({"text_input": b("x"), "sampling_parameters": b(json.dumps(
            {"structured_outputs": {"regex": "a" * 65537}}))})


SPEC_NAMES = [s["name"] for s in INPUT_SPECS]
json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
                           | st.text(max_size=8), lambda c: st.lists(c, max_size=3)
                           | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=6)
arrays = st.one_of(
    st.builds(lambda xs: np.array(xs, dtype=np.object_), st.lists(st.binary(max_size=12), min_size=0, max_size=3)),
    st.builds(lambda xs: np.array(xs, dtype=np.int32), st.lists(st.integers(-2**31, 2**31 - 1), max_size=4)),
    st.builds(lambda xs: np.array(xs, dtype=np.float32), st.lists(st.floats(width=32), max_size=3)),
    st.builds(lambda xs: np.array(xs, dtype=bool), st.lists(st.booleans(), max_size=2)),
    st.builds(lambda xs: np.array(xs, dtype=np.uint64), st.lists(st.integers(0, 2**64 - 1), max_size=2)),
    st.builds(lambda d: b(json.dumps(d)), st.dictionaries(
        st.sampled_from(["max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                         "stop_token_ids", "ignore_eos", "repetition_penalty", "bad_words", "bad_words_token_ids",
                         "bogus"]), json_values, max_size=5)),
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(SPEC_NAMES), arrays, max_size=6))
def test_fuzz_never_crashes(inputs):
    try:
        req = parse_request(inputs, tokenize=lambda t: [len(t)])
    except InvalidRequestError as e:
        assert str(e)
        return
    assert req.prompt
    assert req.params.max_tokens is None or req.params.max_tokens >= 1


def test_vllm_structured_outputs_key_maps_to_guided_fields():
    sp = json.dumps({"structured_outputs": json.dumps({"choice": ["Positive", "Negative"]}), "temperature": "0"})
    req = parse_request({"text_input": np.array([b"x"], dtype=object), "sampling_parameters": np.array([sp.encode()], dtype=object)})
    assert req.params.guided_choice == ["Positive", "Negative"]
    sp = json.dumps({"structured_outputs": {"json": {"type": "object"}}})
    req = parse_request({"text_input": np.array([b"x"], dtype=object), "sampling_parameters": np.array([sp.encode()], dtype=object)})
    assert req.params.guided_json == {"type": "object"}


@pytest.mark.parametrize("sp, expected", [
    ({"structured_outputs": {"yaml": "x"}}, "unknown key 'yaml' in sampling parameter 'structured_outputs'"),
    ({"structured_outputs": "{bad"}, "'structured_outputs' not valid JSON"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "at most one of guided_regex, guided_choice"),
    ({"guided_json": "{not json"}, "'guided_json': Value error, not valid JSON"),
    ({"guided_choice": []}, "'guided_choice'"),
    ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens cannot be combined with guided_regex"),
])
def test_bad_guided_parameters_name_the_field(sp, expected):
    with pytest.raises(InvalidRequestError, match=re.escape(expected)):
        parse_request({"text_input": np.array([b"x"], dtype=object),
                       "sampling_parameters": np.array([json.dumps(sp).encode()], dtype=object)})


@pytest.mark.parametrize("raw, expected", [
    ('{"guided_json": "' + '[' * 5000 + ']' * 5000 + '"}', "'guided_json': Value error, nests too deeply"),
    ('{"x": ' + '[' * 5000 + ']' * 5000 + '}', "input 'sampling_parameters' nests too deeply"),
])
def test_deeply_nested_json_is_a_bad_request_not_an_internal_error(raw, expected):
    """json recurses per level: these raised RecursionError, an INTERNAL error (500
    through the OpenAI frontend, whose own body check cannot see into a string)."""
    with pytest.raises(InvalidRequestError, match=re.escape(expected)):
        parse_request({"text_input": np.array([b"x"], dtype=object),
                       "sampling_parameters": np.array([raw.encode()], dtype=object)})


def test_parameters_json_past_4_mib_is_refused_unread_and_a_whole_vocabulary_bias_is_not():
    """Issue 49: sampling parameters' JSON (or the request parameters') of any size were
    read on the execute thread, the request parameters twice."""
    from backend.triton_server.request_parser import MAX_PARAMETERS_JSON_BYTES
    huge = json.dumps({"max_tokens": 2, "stop": ["x" * MAX_PARAMETERS_JSON_BYTES]})
    with pytest.raises(InvalidRequestError, match="input 'sampling_parameters': .* more than"):
        parse_request({"text_input": b("hi"), "sampling_parameters": b(huge)})
    with pytest.raises(InvalidRequestError, match="request parameters: .* more than"):
        parse_request({"text_input": b("hi")}, request_parameters=huge)
    bias = {str(i): -1.5 for i in range(150_000)}
    req = parse_request({"text_input": b("hi"), "sampling_parameters": b(json.dumps({"logit_bias": bias}))},
                        limits=RequestLimits.defaults())
    assert len(req.params.logit_bias) == 150_000


def test_the_vllm_backends_image_input():
    """Input `image`: base64 per element (a data: URL too); the engine gets vLLM's
    prompt dict with the decoded bytes."""
    import base64
    png = b"\x89PNG\r\n\x1a\n..."
    parsed = parse_request({"text_input": np.array([b"what is <|image_pad|>?"], dtype=object),
                            "image": np.array([base64.b64encode(png),
                                               b"data:image/png;base64," + base64.b64encode(png)], dtype=object)})
    assert parsed.images == [png, png]
    assert parsed.engine_prompt() == {"prompt": "what is <|image_pad|>?", "multi_modal_data": {"image": [png, png]}}
    plain = parse_request({"input_ids": np.array([5, 6], dtype=np.int32)})
    assert plain.engine_prompt() == [5, 6]
    with pytest.raises(InvalidRequestError, match="input 'image' element 1 is not valid base64"):
        parse_request({"input_ids": np.array([5], dtype=np.int32), "image": np.array([b"AAAA", b"!!"], dtype=object)})
    assert {"name": "image", "data_type": "TYPE_STRING", "dims": [-1], "optional": True} in INPUT_SPECS
