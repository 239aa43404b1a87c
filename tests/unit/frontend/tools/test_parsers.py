"""Tool-call parsers (frontend/openai_api/tools/) on canned model text: each family's
calls and content, and streamed deltas that reassemble to the unstreamed message however
the text is cut."""

import json
import random

import pytest

from frontend.openai_api.chat_output import ChoiceOutput
from frontend.openai_api.reasoning import REASONING_PARSERS
from frontend.openai_api.tools.parsers import PARSERS
from frontend.openai_api.tools.streaming import NamedFunction, RequiredFunctions

WEATHER = {"city": 'Paris "FR"', "days": 12, "opts": {"u": [1, 2.5, True, None], "s": "a\\b é"}}
CANNED = {
    "hermes": ("Let me check. <tool_call>\n" + json.dumps({"name": "get_weather", "arguments": WEATHER})
               + "\n</tool_call><tool_call>" + json.dumps({"name": "noop", "arguments": {}}) + "</tool_call>",
               "Let me check. ", [("get_weather", WEATHER), ("noop", {})]),
    "llama3_json": ("<|python_tag|>" + json.dumps({"name": "get_weather", "parameters": WEATHER}) + "; "
                    + json.dumps({"name": "noop", "parameters": {}}), None, [("get_weather", WEATHER), ("noop", {})]),
    "mistral": ("Sure.[TOOL_CALLS]" + json.dumps([{"name": "get_weather", "arguments": WEATHER},
                                                  {"name": "noop", "arguments": {}}]),
                "Sure.", [("get_weather", WEATHER), ("noop", {})]),
    "pythonic": ('[get_weather(city=\'Paris "FR"\', days=12, opts={"u": [1, 2.5, True, None], "s": "a\\\\b é"}), '
                 "noop()]", None, [("get_weather", WEATHER), ("noop", {})]),
}


def stream(make, text: str, seed: int) -> dict:
    """Feed `text` in random cuts; gather content, reasoning and calls from the deltas."""
    rng, out = random.Random(seed), make()
    got: dict = {"content": "", "reasoning": "", "calls": []}
    end = 0
    while end < len(text):
        end = min(len(text), end + rng.randint(1, 7))
        d = out.delta(text[:end], final=end == len(text))
        got["content"] += d.get("content", "")
        got["reasoning"] += d.get("reasoning_content", "")
        for c in d.get("tool_calls", []):
            if "id" in c:
                assert c["index"] == len(got["calls"]) and c["function"]["name"]
                got["calls"].append([c["id"], c["function"]["name"], ""])
            got["calls"][c["index"]][2] += c["function"].get("arguments", "")
    return got


@pytest.mark.parametrize("family", sorted(CANNED))
def test_each_parser_reads_its_familys_calls(family):
    text, content, calls = CANNED[family]
    message = ChoiceOutput(None, PARSERS[family]()).message(text)
    assert message["content"] == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"])


@pytest.mark.parametrize("family", sorted(CANNED))
def test_streamed_deltas_reassemble_to_the_unstreamed_message(family):
    text = CANNED[family][0]
    whole = ChoiceOutput(None, PARSERS[family]()).message(text)
    for seed in range(25):
        got = stream(lambda: ChoiceOutput(None, PARSERS[family]()), text, seed)
        assert got["content"] == (whole["content"] or "")
        assert [(n, a) for _, n, a in got["calls"]] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]


def test_mistral_v11_calls():
    text = 'Hi[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]noop[ARGS]{}'
    message = ChoiceOutput(None, PARSERS["mistral"]()).message(text)
    assert message["content"] == "Hi"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == \
        [("get_weather", '{"city": "Oslo"}'), ("noop", "{}")]
    got = stream(lambda: ChoiceOutput(None, PARSERS["mistral"]()), text, 3)
    assert [(n, a) for _, n, a in got["calls"]] == [("get_weather", '{"city": "Oslo"}'), ("noop", "{}")]


@pytest.mark.parametrize("family,text", [
    ("hermes", "Plain text, no calls."), ("hermes", "<tool_call>{not json}</tool_call>"),
    ("llama3_json", "The answer is {x}."), ("llama3_json", "{broken"),
    ("mistral", "no calls here"), ("pythonic", "[1, 2, 3]"), ("pythonic", "just words"),
])
def test_text_that_is_not_calls_is_content(family, text):
    message = ChoiceOutput(None, PARSERS[family]()).message(text)
    assert message["content"] == text and "tool_calls" not in message
    got = stream(lambda: ChoiceOutput(None, PARSERS[family]()), text, 0)
    assert got["content"] == text


def test_a_marker_cut_across_deltas_is_held_back_not_sent_as_content():
    out = ChoiceOutput(None, PARSERS["hermes"]())
    assert out.delta("Hello <tool", final=False) == {"content": "Hello "}
    d = out.delta('Hello <tool_call>{"name": "f", "arguments": {"a": "x', final=False)
    assert d["tool_calls"][0]["function"]["name"] == "f" and "content" not in d


def test_forced_calls_named_and_required():
    named = ChoiceOutput(None, NamedFunction("f")).message('{"a": "hello", "b": [1, 2]}')
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in named["tool_calls"]] == \
        [("f", '{"a": "hello", "b": [1, 2]}')]
    text = '[{"name": "f", "parameters": {"a": "hello world"}}, {"name": "g", "parameters": {}}]'
    required = ChoiceOutput(None, RequiredFunctions()).message(text)
    assert [c["function"]["name"] for c in required["tool_calls"]] == ["f", "g"]
    for seed in range(10):
        got = stream(lambda: ChoiceOutput(None, RequiredFunctions()), text, seed)
        assert [(n, a) for _, n, a in got["calls"]] == [("f", '{"a": "hello world"}'), ("g", "{}")]
    # Cut by max_tokens: a named call's arguments are the text as it is
    cut = ChoiceOutput(None, NamedFunction("f")).message('{"a": "hel')
    assert cut["tool_calls"][0]["function"]["arguments"] == '{"a": "hel'


@pytest.mark.parametrize("name,prompt,text,reasoning,content", [
    ("qwen3", "assistant:<think>", "weighing it</think>It is 4.", "weighing it", "It is 4."),
    ("qwen3", "assistant:", "<think>weighing it</think>It is 4.", "weighing it", "It is 4."),
    ("qwen3", "assistant:", "It is 4.", None, "It is 4."),
    ("qwen3", "assistant:<think>", "still thinking", "still thinking", None),
    ("deepseek_r1", "assistant:", "weighing it</think>It is 4.", "weighing it", "It is 4."),
    ("deepseek_r1", "assistant:", "never closes", "never closes", None),
    # gpt-oss's harmony channels (the markers are special tokens, kept in the text).
    ("openai_gptoss", "", "<|channel|>analysis<|message|>User asks 2+2.<|end|><|start|>assistant<|channel|>final"
     "<|message|>It is 4.", "User asks 2+2.", "It is 4."),
    ("openai_gptoss", "", "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary"
     "<|message|>b<|end|><|start|>assistant<|channel|>final <|message|>c<|d", "a\nb", "c<|d"),
    ("openai_gptoss", "", "<|channel|>analysis<|message|>still thinking", "still thinking", None),
    ("openai_gptoss", "", "<|channel|>analysis<|message|>ok<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>",
     "ok", "4"),
    ("openai_gptoss", "", "It is 4.", None, "It is 4."),
])
def test_reasoning_split_streamed_and_not(name, prompt, text, reasoning, content):
    make = lambda: ChoiceOutput(REASONING_PARSERS[name](prompt))  # noqa: E731
    message = make().message(text)
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    assert message["reasoning"] == reasoning
    for seed in range(10):
        got = stream(make, text, seed)
        assert (got["reasoning"], got["content"]) == (reasoning or "", content or "")


def test_harmony_keeps_special_tokens_in_the_reply():
    from frontend.openai_api.reasoning import reasoning_sampling
    for name, expect in [("openai_gptoss", {"skip_special_tokens": False}), ("qwen3", {})]:
        sampling: dict = {}
        reasoning_sampling(REASONING_PARSERS[name](""), sampling, None)
        assert sampling == expect


@pytest.mark.parametrize("text", [
    '<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}',
    '<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather'
    '<|channel|>commentary json<|message|>{"city": "Paris", "days": 2}<|call|>',
])
def test_harmony_tool_call(text):
    """gpt-oss's call: a commentary message to functions.NAME (the recipient before or after
    the channel; <|call|> is the stop token, in the text or not)."""
    make = lambda: ChoiceOutput(REASONING_PARSERS["openai_gptoss"](""), PARSERS["openai"]())  # noqa: E731
    message = make().message(text)
    assert message["reasoning_content"] == "Need the weather." and message["content"] is None
    call = message["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris", "days": 2})
    for seed in range(5):
        got = stream(make, text, seed)
        assert (got["reasoning"], got["content"]) == ("Need the weather.", "")
        assert [(c[1], json.loads(c[2])) for c in got["calls"]] == [("get_weather", {"city": "Paris", "days": 2})]


def test_tool_calls_are_read_after_the_reasoning():
    text = '<think>call <tool_call>? no</think>Checking.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    make = lambda: ChoiceOutput(REASONING_PARSERS["qwen3"]("assistant:"), PARSERS["hermes"]())  # noqa: E731
    message = make().message(text)
    assert message["reasoning_content"] == "call <tool_call>? no" and message["content"] == "Checking."
    assert message["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'
    got = stream(make, text, 5)
    assert (got["reasoning"], got["content"], got["calls"][0][2]) == ("call <tool_call>? no", "Checking.", '{"x": 1}')
