"""backend_health.py (issue 49 item 10): while the supervisor's /ready says the backend
cannot serve, a new request gets a 503 at once and a request waiting on Triton ends with
it, its Triton call cancelled; an unreachable supervisor changes nothing. The supervisor
here is a stand-in serving /ready's JSON; tests/integration/test_recovery.py hangs a real
backend behind a real supervisor."""

import asyncio
import json
import time

import pytest

from clients.tritonserver import free_port
from frontend.openai_api.backend_health import BackendHealth
from frontend.openai_api.errors import APIError
from frontend.openai_api.triton_client import Generation

LATE = "the backend process of 'llm_0_0' (pid 7) has sent no heartbeat for 6s"


async def fake_supervisor(port: int, answer: dict):
    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        body = json.dumps(answer).encode()
        writer.write(b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n\r\n" + body)
        await writer.drain()
        writer.close()
    return await asyncio.start_server(handle, "127.0.0.1", port)


class HangingCall:
    """A gRPC stream on a hung backend: nothing comes until it is cancelled."""
    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def __aiter__(self):
        return self

    async def __anext__(self):
        await self.cancelled.wait()
        raise asyncio.CancelledError()


class FakeClient:
    def __init__(self) -> None:
        self.calls: list[HangingCall] = []

    def stream_infer(self, requests):
        self.calls.append(HangingCall())
        return self.calls[-1]


async def wait_for(predicate, timeout_s: float = 2.0) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout_s, "timed out"
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


def test_requests_fail_fast_while_the_backend_cannot_serve():
    async def main():
        answer = {"ready": True, "backend_ready": True, "backend_reason": ""}
        port = free_port()
        server = await fake_supervisor(port, answer)
        health = BackendHealth(f"http://127.0.0.1:{port}/ready", interval_s=0.05)
        health.start()
        client = FakeClient()
        waiting = Generation(client, "llm", [1, 2, 3], {"max_tokens": 4}, True, False)
        health.watch(waiting)
        outcome: list = []

        async def consume():
            try:
                async for _ in waiting:
                    pass
            except APIError as e:
                outcome.append(e)
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.2)
        health.check()                                  # serving: nothing raised
        assert not outcome and len(client.calls) == 1
        answer.update(ready=False, backend_ready=False, backend_reason=LATE)
        waited = await wait_for(lambda: outcome)
        assert waited < 0.5 and outcome[0].status == 503 and LATE in outcome[0].message
        assert client.calls[0].cancelled.is_set()       # its Triton call cancelled
        with pytest.raises(APIError) as e:
            health.check()                              # a new request: 503 at once
        assert e.value.status == 503 and "retry" in e.value.message
        # A request made but not yet sent when the backend stops serving is never sent.
        unsent = Generation(client, "llm", [1], {"max_tokens": 4}, True, False)
        unsent.fail(health.error())
        with pytest.raises(APIError):
            async for _ in unsent:
                pass
        assert len(client.calls) == 1
        answer.update(ready=True, backend_ready=True, backend_reason="")
        await wait_for(lambda: not health.reason)
        health.check()
        await task
        await health.close()
        server.close()
    asyncio.run(main())


def test_an_unreachable_supervisor_changes_nothing():
    async def main():
        health = BackendHealth(f"http://127.0.0.1:{free_port()}/ready", interval_s=0.05)
        health.start()
        await asyncio.sleep(0.3)
        health.check()
        assert health.reason == ""
        await health.close()
    asyncio.run(main())


class ErrorThenHang(HangingCall):
    """Triton has sent the request's error and its FINAL is still to come."""
    def __init__(self) -> None:
        super().__init__()
        self.sent = False

    async def __anext__(self):
        if not self.sent:
            self.sent = True
            return None, type("Error", (), {"message": lambda self: "UNAVAILABLE: queue full"})()
        return await super().__anext__()


def test_a_request_whose_end_triton_sent_is_left_to_read_on():
    """A cancel before Triton's final response left the request behind in Triton 24.10:
    a request that got its error reads on to FINAL, whatever the backend's health."""
    async def main():
        client = FakeClient()
        client.stream_infer = lambda requests: client.calls.append(ErrorThenHang()) or client.calls[-1]
        generation = Generation(client, "llm", [1], {"max_tokens": 4}, True, False)
        health = BackendHealth("http://127.0.0.1:1/ready")
        health.watch(generation)

        async def consume():
            async for _ in generation:
                pass
        task = asyncio.create_task(consume())
        await wait_for(lambda: client.calls and client.calls[0].sent)
        await asyncio.sleep(0.05)
        health._update(LATE)
        assert health.reason == LATE and not client.calls[0].cancelled.is_set()
        task.cancel()
    asyncio.run(main())
