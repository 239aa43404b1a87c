"""Successive parses of a growing text -> the deltas of OpenAI's chat stream.

A call's name goes out once, whole, with the call's id; its arguments go out as pieces of
`json.dumps(arguments)` that only ever extend what was sent: while the text is cut, the
certain part is the dump of what parses so far less its closing quotes and brackets (the
parsers never give cut numbers or literals, whose dump could change). So the pieces of a
stream concatenate to the `arguments` of the same reply unstreamed.

A forced call (tool_choice "required" or named) that max_tokens cuts comes back as OpenAI
returns it: its arguments are the text generated so far, unterminated, and the finish
reason stays "length" (chat_completion.py), never the dump of what parses (`{}` or
`{"city": "Par"}`, which look complete and which a client would run the tool with). So
that a stream ends with the same text, a forced call's pieces never go past what the
model generated (the grammar writes json.dumps' layout, but may escape differently).
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from frontend.openai_api.tools.parsers import Parsed, PartialCall


class RawArguments(str):
    """Arguments that are not JSON (a forced call cut by max_tokens): sent as the text."""


def arguments_text(arguments: Any) -> str:
    if isinstance(arguments, RawArguments):
        return str(arguments)
    return json.dumps({} if arguments is None else arguments, ensure_ascii=False)


def _certain(call: PartialCall) -> str:
    """The part of the arguments' text no later token can change."""
    if call.complete:
        return arguments_text(call.arguments)
    if call.arguments is None:
        return ""
    certain = arguments_text(call.arguments).rstrip('}]"')
    return certain if call.text is None else os.path.commonprefix([certain, call.text])


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class SentCall:
    id: str
    name: str
    arguments: str = ""


class ToolCallDeltas:
    """What one choice has sent so far: content and calls."""

    def __init__(self) -> None:
        self.content = ""
        self.calls: list[SentCall] = []

    def update(self, parsed: Parsed, final: bool) -> tuple[str, list[dict]]:
        """The content delta and the `tool_calls` deltas that take the client from what it
        has to `parsed`. At `final`, whatever certain text was held back goes out."""
        content = ""
        if parsed.content.startswith(self.content):
            content = parsed.content[len(self.content):]
            self.content = parsed.content
        deltas: list[dict] = []
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break                       # later calls wait for this one's name
            if index == len(self.calls):
                self.calls.append(SentCall(new_call_id(), call.name))
                deltas.append({"index": index, "id": self.calls[index].id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            sent = self.calls[index]
            certain = arguments_text(call.arguments) if final else _certain(call)
            if certain.startswith(sent.arguments) and len(certain) > len(sent.arguments):
                piece, sent.arguments = certain[len(sent.arguments):], certain
                if deltas and deltas[-1]["index"] == index:
                    deltas[-1]["function"]["arguments"] += piece
                else:
                    deltas.append({"index": index, "function": {"arguments": piece}})
        return content, deltas

    def message_calls(self) -> list[dict]:
        """The calls as a whole message's `tool_calls`."""
        return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.calls]


class NamedFunction:
    """tool_choice naming a function: the engine's grammar makes the reply that function's
    arguments (a JSON object), as vLLM does."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, final: bool) -> Parsed:
        from frontend.openai_api.tools.parsers import PARTIAL, partial_json_parser
        if final:
            try:
                args: Any = json.loads(text)
            except ValueError:
                args = RawArguments(text)   # cut by max_tokens: as generated
            return Parsed("", [PartialCall(self.name, args, True)])
        try:
            args = partial_json_parser.loads(text, PARTIAL) if text.strip() else None
        except Exception:
            args = None
        return Parsed("", [PartialCall(self.name, args, text=text)])


class RequiredFunctions:
    """tool_choice "required": the grammar makes the reply a JSON list of
    {"name": <one of the tools>, "parameters": {...}}, at least one."""

    def parse(self, text: str, final: bool) -> Parsed:
        from frontend.openai_api.tools.parsers import PARTIAL, WHOLE_NAMES, partial_json_parser
        if final:
            try:
                items = json.loads(text)
                return Parsed("", [PartialCall(i["name"], i.get("parameters", {}), True) for i in items])
            except (ValueError, TypeError, KeyError):
                pass                        # cut by max_tokens: the calls as far as they go
        try:
            names = partial_json_parser.loads(text, WHOLE_NAMES) if text.strip() else []
            cut = partial_json_parser.loads(text, PARTIAL) if text.strip() else []
        except Exception:
            return Parsed("")
        cut = cut if isinstance(cut, list) else []
        texts = _open_arguments(text)
        calls = []
        for i, item in enumerate(cut):
            name = names[i].get("name") if i < len(names) and isinstance(names[i], dict) else None
            call = PartialCall(name if isinstance(name, str) else None,
                               item.get("parameters") if isinstance(item, dict) else None, final or i < len(cut) - 1)
            if i < len(texts) and texts[i] is not None:     # its arguments have not ended
                call.text = texts[i]
                if final:                   # cut by max_tokens: as generated ("" if not begun)
                    call.arguments = RawArguments(texts[i])
            calls.append(call)
        return Parsed("", calls)


def _open_arguments(text: str) -> list[Optional[str]]:
    """A "required" reply (a JSON list of {"name", "parameters"}), item by item: the text
    of its parameters as generated while they are open ("" before they begin), None once
    they have ended. A scan, not a parse: the text may be cut anywhere."""
    out: list[Optional[str]] = []
    depth, in_str, escape, opened, key, start = 0, False, False, 0, "", None
    for i, ch in enumerate(text):
        if in_str:
            escape, in_str = (False, True) if escape else (ch == "\\", ch != '"')
            if not in_str and depth == 2:
                key = text[opened:i + 1]    # an item's key (or its name's value)
            continue
        if ch == '"':
            in_str, opened = True, i
        elif ch in "[{":
            depth += 1
            if depth == 2:                  # an item begins
                out.append("")
        elif ch in "]}":
            depth -= 1
            if out and (depth == 1 or (depth == 2 and start is not None)):
                out[-1], start = None, None     # its parameters (or the item) ended
        elif ch == ":" and depth == 2 and key == '"parameters"':
            start = i + 1
    if out and start is not None:
        out[-1] = text[start:].lstrip()
    return out


def forced_parser(tool_choice: Any) -> Optional[Any]:
    """The parser of a reply the grammar forces, or None (auto, none)."""
    if isinstance(tool_choice, dict):
        return NamedFunction(tool_choice["function"]["name"])
    if tool_choice == "required":
        return RequiredFunctions()
    return None
