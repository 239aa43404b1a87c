"""tool_choice planning (frontend/openai_api/tools/choice.py): what the engine must
enforce, and a 400 naming the field for each inconsistent combination."""

import jsonschema
import pytest

from frontend.openai_api.errors import APIError
from frontend.openai_api.tools.choice import ToolConfig, plan

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
