"""frontend/openai_api/json_depth.py: nesting measured on bytes, in linear time."""

import time

import pytest

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
