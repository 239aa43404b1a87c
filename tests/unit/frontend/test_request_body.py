"""frontend/openai_api/request_body.py: large bodies decode off the event loop, yielding
to it, with the same result and the same refusals as json.loads."""

import asyncio
import json
import time

import pytest

from frontend.openai_api.errors import APIError
from frontend.openai_api.json_depth import THREAD_BYTES
from frontend.openai_api.request_body import _decode, _decoded


@pytest.mark.parametrize("value", [{"a": [1, 2.5, -3e5, True, None, "é\\u00e9\\n"], "b": {"c": []}},
                                   ["x" * 100, {"k": "v"}] * 10])
def test_the_yielding_scanner_reads_what_json_loads_reads(value):
    body = json.dumps(value).encode()
    assert _decode(body, large=True) == _decode(body) == json.loads(body)


@pytest.mark.parametrize("body", [b'{"a": NaN}', b'{"a": 1', b'{"a": "\x01"}', b"\xff\xfe"])
def test_the_yielding_scanner_refuses_what_json_loads_refuses(body):
    for large in (False, True):
        with pytest.raises(APIError) as e:
            _decode(body, large)
        assert e.value.status == 400


def test_a_large_body_of_small_values_leaves_the_event_loop_running():
    """Issue 49: C json.loads holds the GIL through its call: 12 MiB of 400k small objects
    paused every other request about 0.16 s. Decoded with the pure-Python scanner in a
    thread, the loop gets in every few milliseconds (14 ms at most, measured)."""
    body = json.dumps({"messages": [{"role": "user", "content": "x"}] * 400_000}).encode()
    assert len(body) >= THREAD_BYTES

    async def measure():
        gaps, done = [], asyncio.Event()

        async def tick():
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.01)
        value = await _decoded(body, _decode)
        done.set()
        await ticker
        return value, max(gaps)

    value, gap = asyncio.run(measure())
    assert len(value["messages"]) == 400_000
    assert gap < 0.1, f"the event loop waited {gap * 1000:.0f} ms"
