"""One chat choice's text -> its message: reasoning first (reasoning.py), then tool calls
(tools/), then content. Streamed, each chunk's delta carries what became certain since the
last; unstreamed, the same parsers read the whole text once, so the two agree."""

from __future__ import annotations

from typing import Any, Optional

from frontend.openai_api.reasoning import ReasoningParser
from frontend.openai_api.tools.parsers import Parsed
from frontend.openai_api.tools.streaming import ToolCallDeltas


class ChoiceOutput:
    def __init__(self, reasoning: Optional[ReasoningParser] = None, tools: Optional[Any] = None) -> None:
        self.reasoning = reasoning
        self.tools = tools                  # a parser (tools/parsers.py) or a forced one (streaming.py)
        self.sent_reasoning = ""
        self.sent = ToolCallDeltas()

    @property
    def plain(self) -> bool:
        return self.reasoning is None and self.tools is None

    def delta(self, text: str, final: bool) -> dict:
        """What `text` (the whole reply so far) adds to what was sent: `reasoning_content`
        (also as `reasoning`, vLLM's newer name), `content` and `tool_calls` pieces."""
        out: dict = {}
        rest: Optional[str] = text
        if self.reasoning is not None:
            split = self.reasoning.split(text, final)
            if split.reasoning.startswith(self.sent_reasoning) and len(split.reasoning) > len(self.sent_reasoning):
                piece = split.reasoning[len(self.sent_reasoning):]
                out["reasoning_content"] = out["reasoning"] = piece
                self.sent_reasoning = split.reasoning
            rest = split.content
        if rest is None:
            return out
        parsed = Parsed(rest) if self.tools is None else self.tools.parse(rest, final)
        if final and not parsed.valid:      # it looked like calls but is not: content, as vLLM
            parsed = Parsed(rest)
        content, calls = self.sent.update(parsed, final)
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        return out

    @property
    def called(self) -> bool:
        return bool(self.sent.calls)

    def message(self, text: str) -> dict:
        """The whole message of a finished reply (a fresh ChoiceOutput reads it once)."""
        self.delta(text, final=True)
        message: dict = {"role": "assistant", "content": self.sent.content}
        if self.reasoning is not None:
            reasoning = self.sent_reasoning if self.reasoning.thinks(text, True) else None
            message["reasoning_content"] = message["reasoning"] = reasoning
            if self.reasoning.split(text, True).content is None:
                message["content"] = None   # it never stopped reasoning
        if self.called:
            message["tool_calls"] = self.sent.message_calls()
            message["content"] = self.sent.content or None
        return message
