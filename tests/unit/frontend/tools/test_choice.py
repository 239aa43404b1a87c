"""tool_choice planning (frontend/openai_api/tools/choice.py): what the engine must
enforce, and a 400 naming the field for each inconsistent combination; and the forced
reply read back (tools/streaming.py), whole or cut by max_tokens, streamed or not."""

import json
import random
from types import SimpleNamespace

import jsonschema
import pytest

from frontend.openai_api.chat_completion import ChatCompletion
from frontend.openai_api.chat_output import ChoiceOutput
from frontend.openai_api.errors import APIError
from frontend.openai_api.tools.choice import ToolConfig, plan
from frontend.openai_api.triton_client import Delta

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "noop"}}]
AUTO = ToolConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")


def test_named_function_forces_its_parameters_schema():
    p = plan(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, True, ToolConfig(), guided=False)
    assert p.guided_json == PARAMS and p.finish_reason == "stop"


def test_required_forces_a_list_of_calls_over_the_tools():
    p = plan(TOOLS, "required", False, ToolConfig(), guided=False)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "x"}}], p.guided_json)
    for bad in ([], [{"name": "other", "parameters": {}}], [{"name": "get_weather", "parameters": {}}],
                [{"name": "noop", "parameters": {}}] * 2):          # the last: parallel_tool_calls false
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, p.guided_json)
    assert p.finish_reason == "tool_calls"


def test_auto_is_the_default_with_tools_and_needs_the_servers_parser():
    assert plan(TOOLS, None, True, AUTO, guided=False).tool_choice == "auto"
    assert plan(TOOLS, None, True, AUTO, guided=False).parser(AUTO).name == "hermes"
    assert plan(None, None, True, ToolConfig(), guided=False).tool_choice == "none"
    with pytest.raises(APIError, match="enable-auto-tool-choice") as e:
        plan(TOOLS, None, True, ToolConfig(), guided=False)
    assert e.value.param == "tool_choice"


@pytest.mark.parametrize("tools,choice,guided,match", [
    (None, "required", False, "needs 'tools'"),
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, False, "not among the tools"),
    (TOOLS + TOOLS[:1], "required", False, "unique"),
    (TOOLS, "required", True, "cannot be combined"),
])
def test_inconsistent_combinations_are_400s(tools, choice, guided, match):
    with pytest.raises(APIError, match=match) as e:
        plan(tools, choice, True, AUTO, guided=guided)
    assert e.value.status == 400


def test_server_flags_are_checked():
    with pytest.raises(ValueError, match="tool-call-parser"):
        ToolConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="must be one of"):
        ToolConfig(tool_call_parser="nope")


# A forced call cut by max_tokens (issue 49): as OpenAI, the call comes back with the
# arguments generated so far, unterminated, and finish_reason "length"; never a
# complete-looking "{}" a client would run the tool with.

NAMED = {"type": "function", "function": {"name": "get_weather"}}


def reply(choice, text: str, finish: str, step: int = 0) -> tuple[dict, dict]:
    """The unstreamed choice and what a client gathers from the stream (the text in
    pieces of `step` characters, or 1-7 at random), as ChatCompletion writes them."""
    p = plan(TOOLS, choice, True, ToolConfig(), guided=False)
    req = SimpleNamespace(n=1, model="m", logprobs=False, top_logprobs=None)
    streamed = ChatCompletion(req, lambda: ChoiceOutput(None, p.parser(ToolConfig())), p)
    rng, ends, end = random.Random(step), [], 0
    while end < len(text):
        end = min(len(text), end + (step or rng.randint(1, 7)))
        ends.append(end)
    got: dict = {"content": "", "calls": [], "finish": []}
    for k, end in enumerate(ends):
        d = Delta(0, text[(ends[k - 1] if k else 0):end], [1], finish if end == len(text) else None)
        streamed.add(d)
        choice_chunk = streamed.chunk(d)["choices"][0]
        got["finish"].append(choice_chunk["finish_reason"])
        got["content"] += choice_chunk["delta"].get("content") or ""
        for c in choice_chunk["delta"].get("tool_calls", []):
            if "id" in c:
                got["calls"].append([c["function"]["name"], ""])
            got["calls"][c["index"]][1] += c["function"].get("arguments", "")
    return streamed.whole()["choices"][0], got


def calls(choice: dict) -> list:
    return [[c["function"]["name"], c["function"]["arguments"]] for c in choice["message"].get("tool_calls", [])]


@pytest.mark.parametrize("choice,text,expected", [
    # required: a JSON list of {"name", "parameters"}; the arguments are the parameters' text
    ("required", '[{"name": "get_weather", "parameters": {"city": "Par', [["get_weather", '{"city": "Par']]),
    ("required", '[{"name": "get_weather", "parameters": {"ci', [["get_weather", '{"ci']]),
    ("required", '[{"name": "get_weather", "parameters": {"days": 1', [["get_weather", '{"days": 1']]),
    ("required", '[{"name": "get_weather", "parameters": {"city": "Caf\\u00e9 ',
     [["get_weather", '{"city": "Caf\\u00e9 ']]),
    ("required", '[{"name": "get_weather", "parameters": {"parameters": {"x": "y',     # a key named so
     [["get_weather", '{"parameters": {"x": "y']]),
    ("required", '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "noop", "parameters": {"a',
     [["get_weather", '{"city": "Oslo"}'], ["noop", '{"a']]),
    # the name is whole, its arguments not begun: nothing generated, nothing made up
    ("required", '[{"name": "get_weather", "par', [["get_weather", ""]]),
    ("required", '[{"name": "get_weather"', [["get_weather", ""]]),
    # a named function: the reply is its arguments
    (NAMED, '{"city": "Par', [["get_weather", '{"city": "Par']]),
    (NAMED, '{"city": "Paris", "days": 1', [["get_weather", '{"city": "Paris", "days": 1']]),
    (NAMED, '{"city": "Caf\\u00e9 ', [["get_weather", '{"city": "Caf\\u00e9 ']]),
])
def test_a_forced_call_cut_by_max_tokens_keeps_its_partial_arguments(choice, text, expected):
    whole, _ = reply(choice, text, "length")
    assert whole["finish_reason"] == "length"
    assert calls(whole) == expected
    for step in (0, 1, 2, 3, 5, 100):
        _, got = reply(choice, text, "length", step)
        assert got["calls"] == expected
        assert got["finish"][-1] == "length" and not any(got["finish"][:-1])


@pytest.mark.parametrize("text", ['[{"name', '[{"name": "get_wea',
                                  '[{"name": "get_weather", "parameters": {}}, {"na'])
def test_a_required_call_cut_before_its_name_is_whole_is_left_out(text):
    whole, _ = reply("required", text, "length")
    assert whole["finish_reason"] == "length"
    assert calls(whole) == ([["get_weather", "{}"]] if "}}" in text else [])
    assert not whole["message"]["content"]          # not the cut call as text either
    for step in (0, 1, 4):
        _, got = reply("required", text, "length", step)
        assert got["calls"] == calls(whole) and got["content"] == "" and got["finish"][-1] == "length"


@pytest.mark.parametrize("choice,text,finish_reason,expected", [
    ("required", '[{"name": "get_weather", "parameters": {"city": "Paris"}}]', "tool_calls",
     [["get_weather", '{"city": "Paris"}']]),
    ("required", '[{"name": "get_weather", "parameters": {"city": "Caf\\u00e9"}}, {"name": "noop", "parameters": {}}]',
     "tool_calls", [["get_weather", '{"city": "Café"}'], ["noop", "{}"]]),
    (NAMED, '{"city": "Paris"}', "stop", [["get_weather", '{"city": "Paris"}']]),
    (NAMED, '{"city": "Caf\\u00e9"}', "stop", [["get_weather", '{"city": "Café"}']]),
])
def test_a_whole_forced_call_is_unchanged(choice, text, finish_reason, expected):
    whole, _ = reply(choice, text, "stop")
    assert whole["finish_reason"] == finish_reason and calls(whole) == expected
    for step in (0, 1, 3, 100):
        _, got = reply(choice, text, "stop", step)
        assert got["calls"] == expected and got["finish"][-1] == finish_reason


# The arguments as the model writes them (the grammar's layout; an escape json.dumps
# would not write, brackets and quotes inside strings, a key named "parameters").
WRITTEN = ('{"city": "Caf\\u00e9 [1] {\\"2\\"}", "parameters": {"n": [1, -2.5e3, true, null]}}', "{}")


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_every_cut_of_a_forced_reply(choice):
    """Cut anywhere: each call whose name is whole is there; arguments that ended are
    json.dumps of their value, the open one is its text as generated; streamed the same."""
    if choice == "required":
        text = "[" + ", ".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in zip(("get_weather", "noop"),
                                                                                       WRITTEN)) + "]"
        items = [("get_weather", text.index(WRITTEN[0]), WRITTEN[0]), ("noop", text.rindex(WRITTEN[1]), WRITTEN[1])]
        named_by = [text.index('"get_weather"') + 13, text.index('"noop"') + 6]
    else:
        text, items, named_by = WRITTEN[0], [("get_weather", 0, WRITTEN[0])], [0]
    for cut in range(1, len(text)):
        expected = []
        for (name, start, written), whole_name in zip(items, named_by):
            if cut < whole_name:
                break
            done = cut >= start + len(written)
            expected.append([name, json.dumps(json.loads(written), ensure_ascii=False) if done
                             else text[start:max(start, cut)]])
        whole, _ = reply(choice, text[:cut], "length")
        assert calls(whole) == expected and whole["finish_reason"] == "length", text[:cut]
        for step in (0, 1, 3):
            assert reply(choice, text[:cut], "length", step)[1]["calls"] == expected, (text[:cut], step)
