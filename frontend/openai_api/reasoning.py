"""Reasoning parsers (`--reasoning-parser deepseek_r1|qwen3`, vLLM's names): a reply's
<think>...</think> block -> `reasoning_content`, the rest -> content (and tool calls).

Like the tool parsers, a parser reads the whole text so far and says what is certain:
the reasoning, and the text after the block once the block has ended (None before).
"""

from __future__ import annotations

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


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (ReasoningParser, Qwen3)}


def grammar_after_reasoning(parser: Optional[ReasoningParser], sampling: dict, tokenizer) -> None:
    """A guided reply that reasons first: its grammar starts after </think>."""
    if parser is not None and parser.reasons_first and any(k.startswith("guided_") for k in sampling):
        sampling["reasoning_end_token_ids"] = tokenizer(END, add_special_tokens=False)["input_ids"]
