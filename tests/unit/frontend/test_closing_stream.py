"""frontend/openai_api/closing_stream.py: a client that leaves mid-stream closes the
event generator at once (its `finally` cancels the Triton request), not when the
garbage collector gets to it."""

import asyncio
import gc

import pytest
from starlette.responses import StreamingResponse

from frontend.openai_api.closing_stream import ClosingStreamingResponse, first_delta
from frontend.openai_api.triton_client import ClientDisconnected


async def _leave_mid_stream(response_class) -> list[str]:
    closed: list[str] = []

    async def events():
        try:
            while True:
                yield "data: {}\n\n"
        finally:
            closed.append("closed")

    body = events()
    sent_body = asyncio.Event()

    async def send(message):
        if message["type"] == "http.response.body":
            sent_body.set()
            await asyncio.Event().wait()      # a slow client: the chunk is still being sent

    async def receive():
        await sent_body.wait()
        return {"type": "http.disconnect"}    # ... when the client leaves

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    await response_class(body, media_type="text/event-stream")(scope, receive, send)
    return list(closed)    # now, `body` still referenced: only an explicit close has run its finally


def test_a_disconnect_closes_the_event_generator_at_once():
    gc.disable()
    try:
        assert asyncio.run(_leave_mid_stream(ClosingStreamingResponse)) == ["closed"]
        assert asyncio.run(_leave_mid_stream(StreamingResponse)) == []   # what Starlette alone does
    finally:
        gc.enable()


class _QueuedGeneration:
    """A request still waiting to be scheduled: no delta until it is cancelled."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    async def deltas(self):
        await self.cancelled.wait()
        raise ClientDisconnected("r1")
        yield  # an async generator, as Generation's


class _LeavingClient:
    async def receive(self):
        await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}


def test_a_client_leaving_before_the_first_token_cancels_its_request():
    gen = _QueuedGeneration()

    async def run():
        with pytest.raises(ClientDisconnected):
            await asyncio.wait_for(first_delta(_LeavingClient(), gen, gen.deltas()), 5)

    asyncio.run(run())
    assert gen.cancelled.is_set()
