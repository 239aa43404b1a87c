"""frontend/openai_api/request_body.py: large bodies decode off the event loop, yielding
to it, with the same result and the same refusals as json.loads."""

import asyncio
import json
import time

import pytest

from benchmarks.event_loop_stall import longest_wait
from frontend.openai_api.errors import APIError
from frontend.openai_api.json_depth import THREAD_BYTES
from frontend.openai_api.request_body import _decode, _decoded


@pytest.mark.parametrize("value", [{"a": [1, 2.5, -3e5, True, None, "é\\u00e9\\n"], "b": {"c": []}},
                                   ["x" * 100, {"k": "v"}] * 10])
def test_the_yielding_scanner_reads_what_json_loads_reads(value):
    body = json.dumps(value).encode()
    assert _decode(body, large=True) == _decode(body) == json.loads(body)


@pytest.mark.parametrize("body", [json.dumps({"a": "😀 é"}).encode(), json.dumps({"a": "😀 é"}, ensure_ascii=False).encode(),
                                  json.dumps({"a": 1.5e300, "b": 2**70}).encode(), '{"a": "😀"}'.encode("utf-16")])
def test_strict_decoding_still_reads_every_valid_body(body):
    """A surrogate pair (escaped, or as UTF-8), a large but finite number, UTF-16."""
    assert _decode(body) == _decode(body, large=True) == json.loads(body)


@pytest.mark.parametrize("body", [b'{"a": NaN}', b'{"a": 1', b'{"a": "\x01"}', b"\xff\xfe",
                                  # a raw UTF-8 surrogate (json.loads of bytes took it), numbers past a float
                                  b'{"a": "\xed\xa0\x80"}', b'{"a": 1e999}', b'{"a": -1' + b"0" * 400 + b'.5}'])
def test_the_yielding_scanner_refuses_what_json_loads_refuses(body):
    for large in (False, True):
        with pytest.raises(APIError) as e:
            _decode(body, large)
        assert e.value.status == 400


def test_a_large_body_of_small_values_leaves_the_event_loop_running():
    """Issue 49: C json.loads holds the GIL through its call: 12 MiB of 400k small objects
    paused every other request about 0.16 s. Decoded with the pure-Python scanner in a
    thread, the loop gets in every few milliseconds (14 ms at most, measured alone).
    Bounded against the decode's own time, which a loaded machine (CI's two lanes)
    stretches as it stretches the loop's waits: a decode holding the GIL throughout would
    make the loop wait all of it."""
    body = json.dumps({"messages": [{"role": "user", "content": "x"}] * 400_000}).encode()
    assert len(body) >= THREAD_BYTES

    t0 = time.perf_counter()
    value, gap = asyncio.run(longest_wait(_decoded(body, _decode)))
    took = time.perf_counter() - t0
    assert len(value["messages"]) == 400_000
    assert gap < min(0.25 * took, 0.5), f"the event loop waited {gap * 1000:.0f} ms of the decode's {took * 1000:.0f} ms"


class _Request:
    """A Starlette request as read_json sees it: headers and a body stream, which waits
    for `release` before its last chunk (a slow client)."""

    def __init__(self, size: int, declared: bool, release: asyncio.Event) -> None:
        body = json.dumps({"pad": "x" * (size - 11)}).encode()
        self.headers = {"content-length": str(len(body))} if declared else {}
        self.body, self.release, self.read = body, release, False

    async def stream(self):
        self.read = True
        yield self.body[:THREAD_BYTES]
        await self.release.wait()
        yield self.body[THREAD_BYTES:]


def test_at_most_max_large_bodies_are_held_at_once_the_next_is_a_503_unread():
    """Issue 49: large bodies waited for the one decoding thread without bound, each up to
    16 MiB. Past MAX_LARGE_BODIES (declared or grown large) the next is refused before
    its body is read; every slot is given back, whatever the outcome."""
    from frontend.openai_api import request_body

    async def scenario():
        release = asyncio.Event()
        slow = [_Request(THREAD_BYTES + 100, declared=i % 2 == 0, release=release)
                for i in range(request_body.MAX_LARGE_BODIES)]
        reads = [asyncio.create_task(request_body.read_json(r, 16 << 20)) for r in slow]
        await asyncio.sleep(0.05)
        assert request_body._slots.taken == request_body.MAX_LARGE_BODIES
        extra = _Request(THREAD_BYTES + 100, declared=True, release=release)
        with pytest.raises(APIError) as e:
            await request_body.read_json(extra, 16 << 20)
        assert e.value.status == 503 and not extra.read
        small = _Request(1000, declared=True, release=release)      # small bodies take no slot
        release.set()
        assert (await request_body.read_json(small, 16 << 20))["pad"] == "x" * 989
        values = await asyncio.gather(*reads)
        assert all(len(v["pad"]) == THREAD_BYTES + 89 for v in values)
        assert request_body._slots.taken == 0
        bad = _Request(THREAD_BYTES + 100, declared=True, release=release)
        bad.body = bad.body[:-1]                                     # not JSON: a 400, the slot back
        with pytest.raises(APIError) as e:
            await request_body.read_json(bad, 16 << 20)
        assert e.value.status == 400 and request_body._slots.taken == 0

    asyncio.run(scenario())
