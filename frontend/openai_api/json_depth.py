"""How deeply a request body nests, measured on its bytes before it is parsed.

Python's json reads and writes nested values recursively: a body 100k levels deep makes
`json.loads` raise RecursionError, and a JSON schema a few hundred levels deep parses but
then fails `json.dumps` on its way to Triton (both were 500s). Real bodies nest a few
levels, a JSON schema for structured output a few dozen; MAX_JSON_DEPTH leaves room for
those and refuses the rest with a 400 before any recursive code runs.

The measure is numpy over the bytes, linear, a slice at a time (callers with large
bodies run it in a thread, where the event loop gets in between slices): brackets count unless inside a string; a
quote opens or closes a string unless an odd run of backslashes stands before it; an
unterminated string runs to the end. A regex that matched each string instead cost a
Python-level replacement per string (0.8 s for 16 MiB of short strings, on the event
loop) and, in an earlier form, was quadratic on escaped quotes (55 s at 128 KB).
Backslashes outside strings are not JSON: where the measure then differs from a parser's
view, the parser has already failed at the first of them, before nesting any deeper.
"""

from __future__ import annotations

import asyncio

import numpy as np

MAX_JSON_DEPTH = 128
# Bodies at least this large are measured off the event loop (asyncio.to_thread).
THREAD_BYTES = 1 << 20

_STEP = np.zeros(256, np.int8)          # byte -> +1 opens, -1 closes a level
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1
_QUOTE, _BACKSLASH = ord('"'), ord("\\")


# Measured a slice at a time: numpy holds the GIL through some of its passes (0.4 s for
# 12 MiB of small objects paused the event loop 135 ms while a thread measured it); a
# slice of this size holds it for a few milliseconds.
CHUNK_BYTES = 256 << 10


def too_deep(body: bytes, limit: int = MAX_JSON_DEPTH, chunk_bytes: int = CHUNK_BYTES) -> bool:
    """Whether arrays and objects in `body` nest more than `limit` levels deep."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False                    # too few brackets to nest that deep
    raw_all = np.frombuffer(bytes(body), np.uint8)
    quotes = depth = backslashes = 0    # carried from slice to slice
    for start in range(0, raw_all.size, chunk_bytes):
        raw = raw_all[start:start + chunk_bytes]
        quote = raw == _QUOTE
        is_backslash = raw == _BACKSLASH
        if backslashes or is_backslash.any():   # a quote after an odd run of backslashes is escaped
            position = np.arange(raw.size, dtype=np.int64)
            last_plain = np.maximum.accumulate(np.where(is_backslash, -1, position))
            run = np.empty(raw.size, np.int64)  # backslashes standing right before each byte
            run[0] = backslashes
            run[1:] = position[:-1] - last_plain[:-1] + np.where(last_plain[:-1] < 0, backslashes, 0)
            quote &= (run & 1) == 0
            backslashes = int(run[-1] + 1 if is_backslash[-1] else 0)
        outside = ((np.cumsum(quote, dtype=np.int64) + quotes) & 1) == 0
        steps = np.where(outside, _STEP[raw], np.int8(0))
        levels = np.cumsum(steps, dtype=np.int64)
        if depth + int(levels.max(initial=0)) > limit:
            return True
        depth += int(levels[-1])
        quotes += int(np.count_nonzero(quote))
    return False


async def nests_too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """too_deep for a server's event loop: a large body is measured in a thread (16 MiB
    takes up to about half a second, most of it with the GIL released)."""
    if len(body) < THREAD_BYTES:
        return too_deep(body, limit)
    return await asyncio.to_thread(too_deep, body, limit)
