"""Request bodies: read within a byte limit, decoded as strict JSON (depth-checked first),
and parsed into a request model; large ones off the event loop."""

from __future__ import annotations

import asyncio
import json
import json.scanner
import re
from typing import Any, Callable

from pydantic import BaseModel

from frontend.openai_api.errors import APIError
from frontend.openai_api.json_depth import MAX_JSON_DEPTH, THREAD_BYTES, too_deep
from frontend.openai_api.protocol import parse

# What Python's json reads beyond JSON (NaN, Infinity) is refused; so is an escaped lone
# surrogate, a str that no tokenizer or UTF-8 encoder takes (a pair is one character).
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def _finite(number: str) -> float:
    """A JSON number past a float's range (1e999) would be inf, which no JSON reply can
    carry: a Responses `metadata` echoing one was stored, then answered 500."""
    value = float(number)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"the number {number[:32]} is out of range")
    return value


def _text(body: bytes) -> str:
    """The body as text, strictly: json.loads of bytes lets raw UTF-8 surrogate bytes
    (ED A0 80) through as a lone surrogate."""
    return body.decode(json.detect_encoding(body))


async def read_json(request, limit: int) -> Any:
    """The request's body as JSON: 413 past `limit` bytes (before reading any of it when
    the length is declared), 400 when it is not JSON, 503 when MAX_LARGE_BODIES large
    ones are in already."""
    return await _read_and_decode(request, limit, _decode)


async def read_request(request, model_cls: type[BaseModel], limit: int):
    """The request's body as `model_cls` (read_json, then parse)."""
    return await _read_and_decode(request, limit, lambda body, large: parse(model_cls, _decode(body, large)))


# Large bodies are decoded one at a time (each holds a core while it runs)...
_large_bodies = asyncio.Semaphore(1)
# ... and at most this many are read, waiting or decoding at once: each holds up to
# max_request_body_bytes (16 MiB by default) until it is decoded; the next one is refused
# (503, which OpenAI clients retry) before its body is read.
MAX_LARGE_BODIES = 8


class _LargeBodySlots:
    """The count of large bodies in; only the event loop's thread touches it."""

    def __init__(self) -> None:
        self.taken = 0


_slots = _LargeBodySlots()


class _LargeBodySlot:
    """One request's hold on a large body's slot: taken once its body is known to be
    large, given back when the request is done with it."""

    def __init__(self) -> None:
        self.held = False

    def take(self) -> None:
        if self.held:
            return
        if _slots.taken >= MAX_LARGE_BODIES:
            raise APIError(503, f"the server is reading {MAX_LARGE_BODIES} request bodies of "
                                f"{THREAD_BYTES >> 20} MiB or more already: retry")
        _slots.taken += 1
        self.held = True

    def give_back(self) -> None:
        if self.held:
            _slots.taken -= 1
            self.held = False


async def _read_and_decode(request, limit: int, fn: Callable[[bytes, bool], Any]) -> Any:
    slot = _LargeBodySlot()
    try:
        return await _decoded(await _read_body(request, limit, slot), fn)
    finally:
        slot.give_back()


async def _decoded(body: bytes, fn: Callable[[bytes, bool], Any]) -> Any:
    """fn(body, large). A body of 1 MiB or more is decoded and validated in a thread, with
    Python's own pure-Python JSON scanner: C json.loads holds the GIL through its whole
    call, which for 15 MiB of small values paused every other request 0.16-0.33 s; the
    pure-Python scanner lets the event loop in every few milliseconds (14 ms at most,
    measured), at 8-17x the CPU for such bodies (long text stays fast: strings are
    scanned in C). pydantic's validators are Python too, so validation yields as well."""
    if len(body) < THREAD_BYTES:
        return fn(body, False)
    async with _large_bodies:
        return await asyncio.to_thread(fn, body, True)


def _yielding_loads(body: bytes) -> Any:
    decoder = json.JSONDecoder(parse_constant=_not_json, parse_float=_finite)
    decoder.scan_once = json.scanner.py_make_scanner(decoder)
    return decoder.decode(_text(body))


async def _read_body(request, limit: int, slot: _LargeBodySlot) -> bytes:
    """Takes `slot` once the body is large: at once when its declared length is, else
    when it grows so."""
    too_large = APIError(413, f"the request body is larger than max_request_body_bytes ({limit} bytes)",
                         "max_request_body_bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    if declared.isdigit() and int(declared) >= THREAD_BYTES:
        slot.take()
    body = bytearray()
    async for chunk in request.stream():  # a chunked body declares no length: count it
        body += chunk
        if len(body) > limit:
            raise too_large
        if len(body) >= THREAD_BYTES:
            slot.take()
    return bytes(body)


def _decode(body: bytes, large: bool = False) -> Any:
    if too_deep(body):                  # before json.loads, which recurses
        raise APIError(400, f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep")
    try:
        value = _yielding_loads(body) if large else json.loads(_text(body), parse_constant=_not_json,
                                                               parse_float=_finite)
    except ValueError as e:             # JSONDecodeError, UnicodeDecodeError, a constant
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if _SURROGATE.search(body):
        try:
            json.dumps(value, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise APIError(400, "the request body is not valid JSON: a string has a lone UTF-16 surrogate "
                                "(\\ud800-\\udfff)") from None
    return value
