"""A request's tools and tool_choice -> what the template sees, what the engine must
enforce, and how the reply is read. As vLLM's server:

- `none`: the tools go to the template; the reply is text.
- `auto` (the default when tools are given): the model decides; the server's
  `--tool-call-parser` reads its calls. It needs `--enable-auto-tool-choice`.
- `required` / a named function: the engine's structured output forces the reply to be
  calls (a JSON list of {name, parameters} over the tools' schemas) or that function's
  arguments, so arguments always parse and validate, whatever the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from frontend.openai_api.errors import APIError
from frontend.openai_api.tools.parsers import PARSERS
from frontend.openai_api.tools.streaming import forced_parser

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolConfig:
    """The server's flags (vLLM's): --enable-auto-tool-choice, --tool-call-parser."""
    enable_auto_tool_choice: bool = False
    tool_call_parser: Optional[str] = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {sorted(PARSERS)}, not {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


@dataclass
class ToolPlan:
    tools: Optional[list[dict]]             # for the chat template (OpenAI's tool objects)
    tool_choice: Any                        # "none" | "auto" | "required" | {"type": "function", ...}
    guided_json: Optional[dict] = None      # what the engine enforces, if anything
    legacy: bool = False                    # `functions`: answer with `function_call`

    def parser(self, config: ToolConfig):
        forced = forced_parser(self.tool_choice)
        if forced is not None:
            return forced
        if self.tool_choice == "auto" and self.tools:
            return PARSERS[config.tool_call_parser]()
        return None

    @property
    def finish_reason(self) -> str:
        """For a reply with calls: OpenAI says `stop` when a named function was forced."""
        if self.legacy:
            return "function_call"
        return "stop" if isinstance(self.tool_choice, dict) else "tool_calls"


def plan(tools: Optional[list[dict]], tool_choice: Any, parallel_tool_calls: bool, config: ToolConfig,
         guided: bool, legacy: bool = False) -> ToolPlan:
    """Validates the combination (400 naming the field) and plans it. `guided`: the
    request also asks for structured output of its own."""
    param = "function_call" if legacy else "tool_choice"
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if not tools:
        if tool_choice != "none":
            raise APIError(400, f"'{param}' needs '{'functions' if legacy else 'tools'}'", param)
        return ToolPlan(None, "none")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tool names must be unique", "functions" if legacy else "tools")
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        if name not in names:
            raise APIError(400, f"'{param}' names the function '{name}', which is not among the tools", param)
        schema = next(t["function"].get("parameters") for t in tools if t["function"]["name"] == name)
        guided_json = schema or ANY_OBJECT
    elif tool_choice == "required":
        guided_json = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                              "parameters": t["function"].get("parameters") or ANY_OBJECT},
             "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}}
        if not parallel_tool_calls:
            guided_json["maxItems"] = 1
    else:
        guided_json = None
        if tool_choice == "auto" and not config.enable_auto_tool_choice:
            raise APIError(400, f'"auto" {param} needs the server started with --enable-auto-tool-choice and '
                                '--tool-call-parser (or pass "none", "required" or a named function)', param)
    if guided_json is not None and guided:
        raise APIError(400, f"'{param}' {tool_choice if isinstance(tool_choice, str) else 'naming a function'} "
                            "forces the reply's shape: it cannot be combined with response_format or guided_*",
                       param)
    return ToolPlan(tools, tool_choice, guided_json, legacy)
