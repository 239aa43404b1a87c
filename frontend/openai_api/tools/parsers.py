"""Tool-call parsers: a model's text -> content and function calls, one parser per model
family, chosen as vLLM does (`--tool-call-parser hermes|llama3_json|mistral|pythonic|openai`).

Every parser reads the whole text so far (`final=False` while it is still streaming) and
returns what is certain: content that no later token can turn into a call, and each call
with its name once the name is whole and its arguments as far as they parse. streaming.py
turns successive results into deltas, so a parser never keeps state between calls.

`arguments` are parsed JSON values (dicts); the API's `arguments` string is their
`json.dumps`, the same whether streamed or not.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from typing import Any, Optional

import partial_json_parser
from partial_json_parser.core.options import Allow

# While streaming, strings may be cut (their prefix is certain); numbers and literals may
# not (`1` may become `12`, `1.` has no certain form), so they wait until they end.
PARTIAL = Allow.STR | Allow.OBJ | Allow.ARR
WHOLE_NAMES = Allow.OBJ | Allow.ARR          # a name only once its closing quote came


@dataclass
class PartialCall:
    name: Optional[str]                 # None until the name is whole
    arguments: Any = None               # the arguments as far as they parse (a dict), or None
    complete: bool = False              # its text has ended: the arguments are final
    text: Optional[str] = None          # a forced call's arguments as generated so far (streaming.py)


@dataclass
class Parsed:
    content: str                        # certain content (while streaming: it only grows)
    calls: list[PartialCall] = field(default_factory=list)
    valid: bool = True                  # False: the text looked like calls but is not (final only)


def held_back(text: str, marker: str) -> str:
    """`text` less a tail that may be the start of `marker` (its next tokens could finish it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return text[:-k]
    return text


def json_call(body: str, complete: bool, args_keys=("arguments", "parameters")) -> Optional[PartialCall]:
    """{"name": ..., "arguments": {...}} (or "parameters"), whole or cut."""
    if complete:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = next((obj[k] for k in args_keys if k in obj), {})
        return PartialCall(obj["name"], args, True)
    try:
        named = partial_json_parser.loads(body, WHOLE_NAMES) if body.strip() else {}
        cut = partial_json_parser.loads(body, PARTIAL) if body.strip() else {}
    except Exception:                   # not JSON (yet): nothing certain
        return PartialCall(None)
    name = named.get("name") if isinstance(named, dict) else None
    args = next((cut[k] for k in args_keys if isinstance(cut, dict) and k in cut), None)
    return PartialCall(name if isinstance(name, str) else None, args if name else None)


def json_objects(text: str) -> list[tuple[str, bool]]:
    """The top-level JSON objects in `text` (separated by `;`, `,` or spaces), each as
    (its text, closed)."""
    out, depth, start, in_str, escape = [], 0, None, False, False
    for i, ch in enumerate(text):
        if in_str:
            escape, in_str = (False, True) if escape else (ch == "\\", ch != '"')
            continue
        if ch == '"':
            in_str = True
        elif ch == "{":
            start = i if depth == 0 else start
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                out.append((text[start:i + 1], True))
                start = None
    if start is not None:
        out.append((text[start:], False))
    return out


class ToolParser:
    name = ""

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError


class Hermes(ToolParser):
    """Qwen 2.5/3, Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, after
    any content (the content is the text before the first call)."""
    name, start, end = "hermes", "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        head, sep, rest = text.partition(self.start)
        if not sep:
            return Parsed(text if final else held_back(text, self.start))
        calls = []
        for chunk in rest.split(self.start):
            body, closed, _ = chunk.partition(self.end)
            call = json_call(body.strip(), bool(closed) or final)
            if call is None:
                return Parsed(text, [], valid=False) if final else Parsed(head, calls)
            calls.append(call)
        return Parsed(head, calls)


class Llama3Json(ToolParser):
    """Llama 3.1-3.3: the reply is one or more {"name": ..., "parameters": {...}} objects
    (separated by `;`), after an optional <|python_tag|>; any other reply is content."""
    name, tag = "llama3_json", "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        body = body[len(self.tag):].lstrip() if body.startswith(self.tag) else body
        if not body or (not final and self.tag.startswith(text.lstrip())):
            return Parsed("" if not final else text)        # undecided: nothing certain yet
        if not body.startswith("{"):
            return Parsed(text)
        calls = []
        for obj, closed in json_objects(body):
            call = json_call(obj, closed or final)
            if call is None:
                return Parsed(text, [], valid=False) if final else Parsed("", calls)
            calls.append(call)
        return Parsed("", calls)


class Mistral(ToolParser):
    """Mistral: content, then [TOOL_CALLS] and a JSON list of {"name", "arguments"}
    (tokenizer v3), or [TOOL_CALLS]name[ARGS]{...} per call (v11 and later)."""
    name, marker, args_tag = "mistral", "[TOOL_CALLS]", "[ARGS]"

    def parse(self, text: str, final: bool) -> Parsed:
        head, sep, rest = text.partition(self.marker)
        if not sep:
            return Parsed(text if final else held_back(text, self.marker))
        if rest.lstrip().startswith("["):
            return self._listed(text, head, rest.lstrip(), final)
        calls = []
        for chunk in rest.split(self.marker):
            name, has_args, args = chunk.partition(self.args_tag)
            if not has_args:                # the name may still grow
                calls.append(PartialCall(None))
                continue
            objs = json_objects(args)
            if objs and objs[0][1] or final:
                try:
                    calls.append(PartialCall(name.strip(), json.loads(objs[0][0] if objs else args), True))
                    continue
                except ValueError:
                    return Parsed(text, [], valid=False) if final else Parsed(head, calls)
            try:
                cut = partial_json_parser.loads(args, PARTIAL) if args.strip() else None
            except Exception:
                cut = None
            calls.append(PartialCall(name.strip(), cut))
        return Parsed(head, calls)

    def _listed(self, text: str, head: str, body: str, final: bool) -> Parsed:
        if final:
            try:
                items = json.loads(body)
                calls = [PartialCall(c["name"], c.get("arguments", {}), True) for c in items]
                if all(isinstance(c.name, str) for c in calls):
                    return Parsed(head, calls)
            except (ValueError, TypeError, KeyError):
                pass
            return Parsed(text, [], valid=False)
        calls = [json_call(obj, closed) or PartialCall(None) for obj, closed in json_objects(body)]
        return Parsed(head, calls)


class Pythonic(ToolParser):
    """Llama 3.2/4 pythonic: the reply is a Python list of calls, [f(a=1), g(b="x")],
    arguments as literals. Calls are given when the list closes (a cut call has no
    certain arguments); any other reply is content."""
    name = "pythonic"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.strip()
        if not body:
            return Parsed(text if final else "")
        if not body.startswith("["):
            return Parsed(text)
        if not final and not body.endswith("]"):
            return Parsed("")
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not all(isinstance(e, ast.Call) for e in tree.elts):
                raise ValueError("not a list of calls")
            calls = [PartialCall(_dotted(call.func), {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords
                                                      if kw.arg is not None}, True) for call in tree.elts]
            if any(call.args for call in tree.elts):
                raise ValueError("positional arguments")
            return Parsed("", calls)
        except (SyntaxError, ValueError):
            return Parsed(text, [], valid=False) if final else Parsed("")


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise ValueError("not a function name")


class OpenAI(Hermes):
    """gpt-oss (vLLM's `openai`): its calls are harmony messages to `functions.NAME`,
    which the harmony reasoning parser (`--reasoning-parser openai_gptoss`) hands on as
    <tool_call>{"name": NAME, "arguments": ...}</tool_call>: read as Hermes reads them."""
    name = "openai"


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (Hermes, Llama3Json, Mistral, Pythonic, OpenAI)}
