"""frontend/openai_api/json_depth.py: nesting measured on bytes, in linear time."""

import json
import time

import pytest
from hypothesis import given, settings, strategies as st

from frontend.openai_api.json_depth import MAX_JSON_DEPTH, too_deep


@pytest.mark.parametrize("body, deep", [
    (b"[" * (MAX_JSON_DEPTH + 1), True),
    (b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH, False),
    (b'{"a": "' + b"[" * 1000 + b'"}', False),             # brackets inside a string nest nothing
    (b'["\\"' + b"[" * 1000 + b'"]', False),                # an escaped quote does not end the string
    (b'["\\\\"' + b"[" * 1000, True),                       # an escaped backslash does
    (b'"' + b"[" * 200 + b"\\", False),                    # an unterminated string runs to the end
])
def test_depth_is_measured_outside_strings(body, deep):
    assert too_deep(body) is deep


def test_escaped_quotes_in_an_unterminated_string_are_linear():
    """The red team's body: 130 `[`, a quote, then escaped quotes that never close it.
    The old pattern retried from every quote: 128 KB took 55 s on the event loop."""
    body = b"[" * 130 + b'"' + b'\\"' * (1 << 20)            # 2 MiB
    t0 = time.perf_counter()
    assert too_deep(body)                                     # the 130 levels before the string count
    assert time.perf_counter() - t0 < 1.0                     # quadratic: hours
    t0 = time.perf_counter()
    assert not too_deep(b'"' + b'\\"' * (1 << 20) + b"[" * 200)
    assert time.perf_counter() - t0 < 1.0


def _reference_depth(body: bytes) -> int:
    """A parser's view, one byte at a time: the deepest nesting outside strings."""
    depth = deepest = 0
    in_string = escaped = False
    for c in body:
        if in_string:
            if escaped:
                escaped = False
            elif c == ord("\\"):
                escaped = True
            elif c == ord('"'):
                in_string = False
        elif c == ord('"'):
            in_string = True
        elif c in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in b"]}":
            depth -= 1
    return deepest


_TEXT = st.text(alphabet='[]{}"\\ab,:é\n', max_size=8)
_JSON = st.recursive(st.none() | st.integers() | _TEXT,
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
                     max_leaves=40)


@settings(max_examples=400, deadline=None)
@given(_JSON, st.integers(0, 6), st.booleans())
def test_agrees_with_a_byte_by_byte_parser(value, wrap, ascii_only):
    body = b"[" * wrap + json.dumps(value, ensure_ascii=ascii_only).encode() + b"]" * wrap
    deepest = _reference_depth(body)
    for limit in (0, 1, deepest - 1, deepest, deepest + 1):
        for chunk_bytes in (1, 3, 7, 1 << 20):          # slices end anywhere: in strings, in escapes
            assert too_deep(body, max(limit, 0), chunk_bytes) is (deepest > max(limit, 0))


def test_a_large_body_is_measured_off_the_event_loop(monkeypatch):
    import asyncio
    from frontend.openai_api import json_depth
    threads = []
    monkeypatch.setattr(json_depth.asyncio, "to_thread", lambda fn, *a: threads.append(fn) or asyncio.sleep(0, fn(*a)))
    assert asyncio.run(json_depth.nests_too_deep(b"[" * json_depth.THREAD_BYTES))
    assert not asyncio.run(json_depth.nests_too_deep(b"[]"))
    assert threads == [too_deep]
