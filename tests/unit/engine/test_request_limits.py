"""Per-request limits (backend/engine/request_limits.py): each is refused alone with a
message naming the field and the engine argument; the value at the limit is accepted;
the engine's own arguments move each limit; the engine refuses and then serves on."""

import pytest

from backend import LLM, ConfigError, EngineArgs, SamplingParams, SamplingParamsError
from backend.engine.errors import InvalidRequestError
from backend.engine.request_limits import RequestLimits, guided_spec_bytes
from tests.conftest import assert_pool_free

DEFAULTS = RequestLimits.defaults()

# (sampling parameters at the default limit, the same one past it, the message's words)
AT_AND_PAST = [
    ({"n": 64}, {"n": 65}, "sampling parameter 'n' is 65, more than max_n=64 (an engine argument)"),
    ({"logprobs": 20}, {"logprobs": 21},
     "sampling parameter 'logprobs' is 21, more than max_logprobs=20 (an engine argument)"),
    ({"stop": ["s"] * 16}, {"stop": ["s"] * 17},
     "sampling parameter 'stop' has 17 strings, more than max_stop_strings=16 (an engine argument)"),
    ({"stop": ["x" * 512]}, {"stop": ["ok", "x" * 513]},
     "sampling parameter 'stop' has a string of 513 characters, more than max_stop_string_len=512"),
    ({"stop_token_ids": list(range(64))}, {"stop_token_ids": list(range(65))},
     "sampling parameter 'stop_token_ids' has 65 ids, more than max_stop_token_ids=64"),
    ({"guided_regex": "a" * 65536}, {"guided_regex": "a" * 65537},
     "sampling parameter 'guided_regex' is 65537 bytes, more than max_guided_spec_bytes=65536"),
    ({"guided_grammar": "é" * 32768}, {"guided_grammar": "é" * 32768 + "x"},   # UTF-8 bytes, not characters
     "sampling parameter 'guided_grammar' is 65537 bytes, more than max_guided_spec_bytes=65536"),
    ({"guided_choice": ["c" * 65532]}, {"guided_choice": ["c" * 65533]},       # ["..."]: 4 bytes around it
     "sampling parameter 'guided_choice' is 65537 bytes"),
    ({"guided_json": {"enum": ["e" * 65523]}}, {"guided_json": {"enum": ["e" * 65524]}},  # compact JSON
     "sampling parameter 'guided_json' is 65537 bytes"),
]


@pytest.mark.parametrize("at, past, message", AT_AND_PAST, ids=[
    "n", "logprobs", "stop-count", "stop-length", "stop_token_ids", "regex", "grammar", "choice", "json"])
def test_each_limit_refused_past_it_and_accepted_at_it(at, past, message):
    DEFAULTS.check(SamplingParams.create(**at))
    with pytest.raises(InvalidRequestError) as e:
        DEFAULTS.check(SamplingParams.create(**past))
    assert message in str(e.value)


def test_defaults_are_the_engine_arguments_and_vllms():
    args = EngineArgs.create(model="m")
    assert RequestLimits.from_args(args) == DEFAULTS
    assert (DEFAULTS.max_n, DEFAULTS.max_logprobs, DEFAULTS.max_stop_strings, DEFAULTS.max_stop_string_len,
            DEFAULTS.max_stop_token_ids, DEFAULTS.max_guided_spec_bytes, DEFAULTS.request_timeout_s) == (
        64, 20, 16, 512, 64, 65536, None)
    assert args.guided_compile_timeout_s == 10.0


def test_engine_arguments_move_the_limits():
    limits = RequestLimits.from_args(EngineArgs.create(model="m", max_n=2, max_logprobs=0, max_stop_strings=0,
                                                       max_stop_string_len=3, max_stop_token_ids=1,
                                                       max_guided_spec_bytes=8))
    limits.check(SamplingParams(n=2, logprobs=0, stop_token_ids=[7], guided_regex="[0-9]{3}"))
    for params, message in [({"n": 3}, "max_n=2"), ({"logprobs": 1}, "max_logprobs=0"),
                            ({"stop": ["a"]}, "max_stop_strings=0"),
                            ({"stop_token_ids": [1, 2]}, "max_stop_token_ids=1"),
                            ({"guided_regex": "[0-9]{10}"}, "max_guided_spec_bytes=8")]:
        with pytest.raises(InvalidRequestError, match=message):
            limits.check(SamplingParams.create(**params))
    with pytest.raises(InvalidRequestError, match="max_stop_string_len=3"):
        RequestLimits.from_args(EngineArgs.create(model="m", max_stop_string_len=3)).check(
            SamplingParams(stop=["abcd"]))


def test_request_timeout_override_may_shorten_the_engines_never_extend_it():
    bounded = RequestLimits.from_args(EngineArgs.create(model="m", request_timeout_s=10))
    bounded.check(SamplingParams(request_timeout_s=10))
    assert bounded.deadline(SamplingParams(request_timeout_s=2.5)) == (2.5, "sampling parameter")
    assert bounded.deadline(SamplingParams()) == (10, "engine argument")
    with pytest.raises(InvalidRequestError) as e:
        bounded.check(SamplingParams(request_timeout_s=10.5))
    assert str(e.value) == ("sampling parameter 'request_timeout_s' is 10.5, more than the engine argument "
                            "request_timeout_s=10: a request may shorten the engine's deadline, not extend it")
    # No engine deadline (the default): none, unless the request sets one of any length.
    DEFAULTS.check(SamplingParams(request_timeout_s=1e6))
    assert DEFAULTS.deadline(SamplingParams()) is None
    assert DEFAULTS.deadline(SamplingParams(request_timeout_s=1e6)) == (1e6, "sampling parameter")
    for bad in (0, -1, float("inf"), "soon"):
        with pytest.raises(SamplingParamsError, match="'request_timeout_s'"):
            SamplingParams.create(request_timeout_s=bad)


@pytest.mark.parametrize("kw, field", [({"max_n": 0}, "max_n"), ({"max_logprobs": -1}, "max_logprobs"),
                                       ({"max_stop_string_len": 0}, "max_stop_string_len"),
                                       ({"max_guided_spec_bytes": 0}, "max_guided_spec_bytes"),
                                       ({"guided_compile_timeout_s": 0}, "guided_compile_timeout_s"),
                                       ({"request_timeout_s": 0}, "request_timeout_s"),
                                       ({"request_timeout_s": "inf"}, "request_timeout_s")])
def test_bad_limits_name_the_engine_argument(kw, field):
    with pytest.raises(ConfigError, match=f"invalid engine argument '{field}'"):
        EngineArgs.create(model="m", **kw)


def test_guided_spec_size_is_its_utf8_text_or_compact_json():
    assert guided_spec_bytes("ab") == 2 and guided_spec_bytes("é") == 2
    assert guided_spec_bytes({"type": "object"}) == len('{"type":"object"}')
    assert guided_spec_bytes(["a", "b"]) == len('["a","b"]')
    assert guided_spec_bytes(True) == 0                 # guided_json_object


def test_engine_refuses_each_request_alone_and_serves_on(llama_ckpt):
    llm = LLM(llama_ckpt, block_size=4, num_kv_blocks=64, max_logprobs=2, max_stop_strings=1)
    engine = llm.engine
    for params, message in [(SamplingParams(logprobs=3), "'logprobs' is 3, more than max_logprobs=2"),
                            (SamplingParams(stop=["a", "b"]), "'stop' has 2 strings, more than max_stop_strings=1"),
                            (SamplingParams(n=65), "'n' is 65, more than max_n=64"),
                            # was silently dropped by the sampler (issue 31)
                            (SamplingParams(logit_bias={5: 1.0, 10**6: 5.0}),
                             r"'logit_bias': token id 1000000 is outside the vocabulary \[0, ")]:
        with pytest.raises(InvalidRequestError, match=message):
            engine.add_request([5, 6, 7], params)
    assert not engine.has_unfinished_requests()
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, min_tokens=4, logprobs=2, stop=["a"]))[0]
    assert out.error is None and len(out.token_ids) == 4 and len(out.logprobs[0]) >= 2
    assert_pool_free(llm)
