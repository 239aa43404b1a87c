"""Reasoning parsers (`--reasoning-parser deepseek_r1|qwen3|openai_gptoss`, vLLM's names):
a reply's <think>...</think> block (or gpt-oss's harmony analysis channel) ->
`reasoning_content`, the rest -> content (and tool calls).

Like the tool parsers, a parser reads the whole text so far and says what is certain:
the reasoning, and the text after the block once the block has ended (None before).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional

from frontend.openai_api.tools.parsers import held_back

START, END = "<think>", "</think>"


@dataclass
class Split:
    reasoning: str
    content: Optional[str]          # None while the reasoning goes on


class ReasoningParser:
    """DeepSeek-R1: every reply reasons first (its template opens the block), so the text
    up to </think> is reasoning, and a reply that never closes it is all reasoning."""
    name = "deepseek_r1"
    # Whether the reply is detokenized without its special tokens (the parser's markers
    # are plain text); harmony's markers are special tokens.
    skip_special_tokens = True

    def __init__(self, prompt: str = "") -> None:
        # The template opened the block (`<think>` ends the prompt): the reply reasons.
        self.opened_by_prompt = prompt.rstrip().endswith(START)

    def thinks(self, text: str, final: bool) -> Optional[bool]:
        """Whether this reply reasons; None while it cannot be told yet."""
        return True

    @property
    def reasons_first(self) -> bool:
        """Known before the reply: it starts with reasoning. Then structured output waits
        for the reasoning's end (engine `reasoning_end_token_ids`), as vLLM's does."""
        return True

    def split(self, text: str, final: bool) -> Split:
        thinks = self.thinks(text, final)
        if thinks is None:
            return Split("", None)
        if not thinks:
            return Split("", text)
        # A <think> the model wrote itself is dropped (with the spaces before it); the
        # reasoning keeps its own spacing.
        body = text.lstrip()[len(START):] if text.lstrip().startswith(START) else text
        reasoning, closed, rest = body.partition(END)
        if closed:
            return Split(reasoning, rest)
        return Split(reasoning if final else held_back(reasoning, END), None)


class Qwen3(ReasoningParser):
    """Qwen3 (hybrid thinking): a reply reasons when its template opened the block
    (`enable_thinking`) or when it starts with <think>; otherwise it is all content.
    (With structured output and a block the template did not open, the grammar shapes
    the reply from its first token, so it cannot open one itself.)"""
    name = "qwen3"

    @property
    def reasons_first(self) -> bool:
        return self.opened_by_prompt

    def thinks(self, text: str, final: bool) -> Optional[bool]:
        if self.opened_by_prompt:
            return True
        head = text.lstrip()
        if head.startswith(START):
            return True
        if not final and START.startswith(head):
            return None                 # empty, or a cut "<think>"
        return False


CHANNEL, MESSAGE, MESSAGE_END, NEXT = "<|channel|>", "<|message|>", "<|end|>", "<|start|>"
# The reply's own last marker, should the stop token's text reach the reply.
HARMONY_STOPS = ("<|return|>", "<|call|>")
# A message to a function (a tool call): its recipient, in the header before the channel
# or after it (`<|channel|>commentary to=functions.get_weather <|constrain|>json`).
RECIPIENT = re.compile(r"to=functions\.([\w.\-]+)")


class Harmony(ReasoningParser):
    """gpt-oss's harmony format: the reply is messages `<|channel|>NAME<|message|>BODY`,
    ended by `<|end|>` (then `<|start|>assistant` opens the next) or by the stop token.
    Bodies of the `final` channel are the content; a message to `functions.NAME` is a
    tool call, handed on after the content as `<tool_call>{"name": NAME, "arguments":
    BODY}</tool_call>` for the `openai` tool parser (tools/parsers.py); the others
    (`analysis`, commentary preambles) are the reasoning, joined by newlines. A reply not
    in the format is all content. The markers are special tokens, so the reply is
    detokenized with them. (vLLM parses harmony at the token level with openai-harmony;
    this reads the same text.) Structured output is not started after the analysis: a
    guided gpt-oss reply is shaped from its first token."""
    name = "openai_gptoss"
    skip_special_tokens = False

    @property
    def reasons_first(self) -> bool:
        return False

    def thinks(self, text: str, final: bool) -> Optional[bool]:
        head = text.lstrip()
        if head.startswith((CHANNEL, "to=")):       # a first message, or one with a recipient
            return True
        if not final and (CHANNEL.startswith(head) or "to=".startswith(head)):
            return None
        return False

    def split(self, text: str, final: bool) -> Split:
        thinks = self.thinks(text, final)
        if not thinks:
            return Split("", None if thinks is None else text)
        reasoning: list[str] = []
        content: Optional[str] = None
        calls = ""
        for message in text.split(NEXT):
            header, opened, body = message.partition(MESSAGE)
            if not opened:
                continue                        # its header is still being written
            for end in (MESSAGE_END, *HARMONY_STOPS):
                body, ended, _ = body.partition(end)
                if ended:
                    break
            if not ended and not final:
                for end in (MESSAGE_END, NEXT, *HARMONY_STOPS):
                    body = held_back(body, end)
            recipient = RECIPIENT.search(header)
            if recipient is not None:
                calls += (f'<tool_call>{{"name": {json.dumps(recipient.group(1))}, "arguments": {body}'
                          + ("}</tool_call>" if ended or final else ""))
            elif header.partition(CHANNEL)[2].strip().startswith("final"):
                content = body
            else:
                reasoning.append(body)
        if calls:
            content = (content or "") + calls
        return Split("\n".join(reasoning), content)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (ReasoningParser, Qwen3, Harmony)}


def reasoning_sampling(parser: Optional[ReasoningParser], sampling: dict, tokenizer) -> None:
    """What a reply's parser needs of its sampling: special tokens kept when they are its
    markers (harmony); a guided reply that reasons first has its grammar start after
    </think>."""
    if parser is None:
        return
    if not parser.skip_special_tokens:
        sampling["skip_special_tokens"] = False
    if parser.reasons_first and any(k.startswith("guided_") for k in sampling):
        sampling["reasoning_end_token_ids"] = tokenizer(END, add_special_tokens=False)["input_ids"]
