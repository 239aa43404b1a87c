"""A text prompt refused for its length before it is tokenized whole.

Tokenizing costs time in proportion to the text: a 16 MB prompt took 27-46 s (5.6M
tokens) before the engine refused it for max_model_len, and meanwhile every other request
waited. Here a long text is tokenized in chunks of CHUNK_CHARS characters, counting, and
refused as soon as the count shows it cannot fit: the work is bounded by about
max_model_len tokens' worth of text, whatever the prompt's size. A text that fits is then
tokenized whole, so the ids are exactly the tokenizer's.

Chunk counts can exceed the whole text's count a little: each chunk may carry the
tokenizer's BOS, and a cut can split what would be one token. CUT_SLACK_TOKENS per cut
covers that (cuts fall on a space where there is one), so a prompt that fits is never
refused here; one a few tokens over may pass this check and is refused by the engine's
exact one.
"""

from __future__ import annotations

from typing import Callable

from backend.engine.errors import InvalidRequestError

CHUNK_CHARS = 16384
CUT_SLACK_TOKENS = 8


def tokenize_within(tokenize: Callable[[str], list[int]], text: str, max_model_len: int) -> list[int]:
    """`tokenize(text)`, or InvalidRequestError once the text is known to have at least
    max_model_len tokens (no room left for one generated token)."""
    if len(text) <= CHUNK_CHARS:
        return tokenize(text)
    counted = start = cuts = 0
    while start < len(text):
        end = min(start + CHUNK_CHARS, len(text))
        if end < len(text):
            space = text.rfind(" ", start + CHUNK_CHARS // 2, end)
            end = space if space > start else end
        counted += len(tokenize(text[start:end]))
        cuts += 1
        start = end
        if counted - CUT_SLACK_TOKENS * cuts >= max_model_len:
            raise InvalidRequestError(
                f"the prompt has more than {counted - CUT_SLACK_TOKENS * cuts} tokens (counted in its first {start} "
                f"of {len(text)} characters); max_model_len is {max_model_len}, which must leave room for at least "
                "one generated token")
    return tokenize(text)
