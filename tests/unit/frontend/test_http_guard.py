"""frontend/http_guard.py in front of a stand-in upstream (an aiohttp app that echoes
what reached it): what it refuses, what it passes through unchanged, and that a crash
payload's parsing leaves other requests served. tests/integration/test_http_guard.py
puts a real tritonserver behind it."""

import asyncio
import json
import logging
import time

from aiohttp import ClientSession, web

from clients.tritonserver import free_port
from frontend.http_guard import make_app
from frontend.openai_api.auth import APIKeys


async def _upstream(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    if request.path.endswith("/unparsable"):        # Triton's words for a body it cannot read
        return web.json_response({"error": "Unable to parse 'data': attempt to access JSON non-signed-integer "
                                           "as signed-integer"}, status=500)
    if request.path.endswith("/keep-alive"):     # whether the guard keeps this connection open
        return web.json_response({"keep_alive": request.keep_alive}, status=201)
    if request.path.endswith("/internal"):
        return web.json_response({"error": "an internal failure"}, status=500)
    if request.path.endswith("generate_stream"):
        r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        try:
            for i in range(int(request.query.get("n", 3))):
                await r.write(f"data: {i}\n\n".encode())
                await asyncio.sleep(0.02)
            await r.write_eof()
        except ConnectionResetError:
            pass                            # the guard closed this side: its client left
        return r
    if request.headers.get("Accept-Encoding") == "gzip":
        response = web.json_response({"method": request.method}, status=201)
        response.enable_compression()
        return response
    return web.json_response({"method": request.method, "len": len(body), "body": body[:64].decode(errors="replace"),
                              "key": request.headers.get("triton-admin-key"), "query": request.query_string,
                              "chunked": request.headers.get("Transfer-Encoding"),
                              "coding": request.headers.get("Content-Encoding"),
                              "length": request.headers.get("Content-Length")}, status=201)


def run(scenario, max_body_bytes=1 << 20, upstream_up=True, api_keys=APIKeys(), openai_only=False):
    async def main():
        up_port, guard_port = free_port(), free_port()
        runners = []
        if upstream_up:
            app = web.Application(client_max_size=1 << 30)
            app.router.add_route("*", "/{t:.*}", _upstream)
            runners.append((web.AppRunner(app), up_port))
        runners.append((web.AppRunner(make_app(f"127.0.0.1:{up_port}", max_body_bytes, api_keys, openai_only)), guard_port))
        for runner, port in runners:
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with ClientSession() as session:
                return await scenario(session, f"http://127.0.0.1:{guard_port}", guard_port)
        finally:
            for runner, _ in reversed(runners):
                await runner.cleanup()
    return asyncio.run(main())


def test_requests_pass_through_unchanged():
    async def scenario(s, url, _):
        async with s.post(url + "/v2/models/llm/infer?x=1", data=b'{"inputs": [{"data": [[1]]}]}',
                          headers={"triton-admin-key": "k"}) as r:
            return r.status, await r.json()
    status, seen = run(scenario)
    assert status == 201
    assert seen == {"method": "POST", "len": 29, "body": '{"inputs": [{"data": [[1]]}]}', "key": "k", "query": "x=1",
                    "chunked": None, "coding": None, "length": "29"}


def test_no_idle_connection_to_the_upstream_is_kept():
    """Triton's shutdown waits for every open HTTP connection, an idle one of the guard's
    pool too: 30 s of every `make serve` stop. Each request's connection closes with it."""
    async def scenario(s, url, _):
        seen = []
        for _ in range(2):
            async with s.get(url + "/v2/keep-alive") as r:
                seen.append((r.status, (await r.json())["keep_alive"]))
        return seen
    assert run(scenario) == [(201, False), (201, False)]


def test_clients_that_leave_mid_stream_log_no_traceback_and_others_are_served(caplog):
    """Issue 49 item 13: each client that closed a stream mid-answer left a traceback in
    the log ("Error handling request", ConnectionResetError), a flood under load."""
    async def leave_mid_stream(port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v2/models/llm/generate_stream?n=40 HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Length: 2\r\n\r\n{}")
        await reader.readuntil(b"data: 0")
        writer.transport.abort()            # a reset, mid-answer

    async def scenario(s, url, port):
        await asyncio.gather(*(leave_mid_stream(port) for _ in range(8)))
        async with s.get(url + "/v2/models/llm/generate_stream") as r:
            whole = await r.read()
        await asyncio.sleep(1.0)            # the left streams' next writes fail meanwhile
        return whole
    with caplog.at_level(logging.DEBUG):
        assert run(scenario) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], \
        [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert sum("client left mid-answer" in r.getMessage() for r in caplog.records) == 8


def test_a_compressed_answer_keeps_its_coding():
    async def scenario(s, url, _):
        async with s.get(url + "/v2/models/llm/infer", headers={"Accept-Encoding": "gzip"}) as r:
            return r.status, r.headers.get("Content-Encoding"), await r.json()      # aiohttp unpacks it
    status, coding, seen = run(scenario)
    assert (status, coding, seen["method"]) == (201, "gzip", "GET")


def test_server_sent_events_stream_through():
    async def scenario(s, url, _):
        async with s.post(url + "/v2/models/llm/generate_stream", data=b"{}") as r:
            arrivals = []
            async for line in r.content:
                if line.strip():
                    arrivals.append((line.strip(), time.monotonic()))
            return r.headers["Content-Type"], arrivals
    content_type, arrivals = run(scenario)
    assert content_type == "text/event-stream" and [a for a, _ in arrivals] == [b"data: 0", b"data: 1", b"data: 2"]
    assert arrivals[-1][1] - arrivals[0][1] > 0.03      # as they came, not buffered to the end


def test_deep_json_is_refused_before_triton_parses_it():
    async def scenario(s, url, _):
        async with s.post(url + "/v2/models/llm/infer", data=b"[" * (1 << 20)) as r:   # the red team's 1 MB
            return r.status, await r.json()
    status, body = run(scenario, max_body_bytes=4 << 20)
    assert status == 400 and "levels deep" in body["error"]


def test_the_binary_extension_checks_only_its_json_header():
    header = b'{"inputs": [{"name": "x", "parameters": {"binary_data_size": 256}}]}'
    payload = header + b"[" * 256                         # tensor bytes may look like anything

    async def scenario(s, url, _):
        out = []
        for declared in (str(len(header)), str(len(payload) + 1), "x"):
            async with s.post(url + "/v2/models/llm/infer", data=payload,
                              headers={"Inference-Header-Content-Length": declared}) as r:
                out.append(r.status)
        return out
    assert run(scenario) == [201, 400, 400]


def test_the_binary_header_counts_only_on_infer_and_only_once():
    """/generate parses its whole body as JSON whatever the header says; a header sent
    twice let the guard check the first value while Triton took the last (review)."""
    deep = b"[" * 200_000

    async def scenario(s, url, _):
        out = []
        async with s.post(url + "/v2/models/llm/generate", data=deep,
                          headers={"Inference-Header-Content-Length": "1"}) as r:
            out.append(r.status)
        async with s.post(url + "/v2/models/llm/infer", data=deep,
                          headers=[("Inference-Header-Content-Length", "0"),
                                   ("Inference-Header-Content-Length", "200000")]) as r:
            out.append(r.status)
        async with s.post(url + "/v2/models/llm/infer", data=b"{}",
                          headers={"Inference-Header-Content-Length": "\u00b2"}) as r:   # '²'.isdigit()
            out.append(r.status)
        return out
    assert run(scenario) == [400, 400, 400]


def test_compressed_bodies_are_checked_and_sent_on_unpacked():
    """aiohttp unpacks gzip; Triton unpacks it again if told so: a body gzipped twice got
    a deep body past the check, and a small bomb past the bound (review)."""
    import gzip
    deep = b"[" * 200_000

    async def scenario(s, url, _):
        out = []
        async with s.post(url + "/v2/models/llm/infer", data=gzip.compress(b'{"inputs": []}'),
                          headers={"Content-Encoding": "gzip"}) as r:
            out.append((r.status, await r.json()))
        async with s.post(url + "/v2/models/llm/infer", data=gzip.compress(deep),
                          headers={"Content-Encoding": "gzip"}) as r:
            out.append(r.status)
        async with s.post(url + "/v2/models/llm/infer", data=gzip.compress(gzip.compress(deep)),
                          headers={"Content-Encoding": "gzip"}) as r:
            out.append((r.status, (await r.json())["len"]))             # plain gzip bytes: Triton's 400
        async with s.post(url + "/v2/models/llm/infer", data=gzip.compress(b" " * (8 << 20)),
                          headers={"Content-Encoding": "gzip"}) as r:
            out.append(r.status)                                        # 8 KB packed, 8 MiB unpacked
        async with s.post(url + "/v2/models/llm/infer", data=b"xx", headers={"Content-Encoding": "compress"}) as r:
            out.append(r.status)
        return out
    plain, deep_status, twice, bomb, brotli = run(scenario, max_body_bytes=1 << 20)
    assert plain[0] == 201 and plain[1]["len"] == 14 and plain[1]["body"] == '{"inputs": []}'
    assert plain[1]["coding"] is None
    assert deep_status == 400 and twice[0] == 201 and bomb == 413 and brotli == 415


def test_bodies_past_the_limit_get_413_declared_or_chunked():
    """Issue 49 item 12 (a 300 MB `/generate` body was accepted): refused past the limit,
    declared or chunked, and a request sent while the chunked one trickles in is answered
    without waiting for it."""
    async def chunks():
        for _ in range(64):
            yield b"x" * 1024
            await asyncio.sleep(0.01)

    async def scenario(s, url, _):
        async with s.post(url + "/v2/models/llm/infer", data=b"x" * 70_000) as r:
            declared = r.status

        async def oversized():
            async with s.post(url + "/v2/models/llm/infer", data=chunks()) as r:
                return r.status, (await r.json())["error"], time.monotonic()

        async def normal():
            await asyncio.sleep(0.05)                   # (the oversized body is on its way)
            async with s.get(url + "/v2/health/ready") as r:
                return r.status, time.monotonic()
        (chunked, message, refused_at), (ready, answered_at) = await asyncio.gather(oversized(), normal())
        return declared, chunked, message, ready, answered_at < refused_at
    declared, chunked, message, ready, answered_first = run(scenario, max_body_bytes=60_000)
    assert declared == chunked == 413 and "--max-body-bytes" in message
    assert ready == 201 and answered_first


def test_many_one_byte_chunks_reach_triton_as_one_body_and_others_are_served():
    """CVE-2025-23310's shape (600k one-byte chunks crashed Triton 24.10): the guard
    de-chunks them, and a request sent meanwhile is answered without waiting for it."""
    json_body = b'{"text_input": "' + b"a" * 200_000 + b'"}'
    wire = b"".join(b"1\r\n" + bytes([c]) + b"\r\n" for c in json_body) + b"0\r\n\r\n"

    async def scenario(s, url, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v2/models/llm/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")

        async def send():
            for i in range(0, len(wire), 65536):
                writer.write(wire[i:i + 65536])
                await writer.drain()

        async def probe():
            t0 = time.monotonic()
            async with s.get(url + "/v2/health/ready") as r:
                assert r.status == 201
            return time.monotonic() - t0

        sender = asyncio.create_task(send())
        waits = []
        while not sender.done():
            waits.append(await probe())
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        seen = json.loads(await reader.readexactly(length))
        writer.close()
        return head.split(b"\r\n")[0], seen, waits
    status_line, seen, waits = run(scenario)
    assert status_line == b"HTTP/1.1 201 Created"
    assert seen["len"] == len(json_body) and seen["chunked"] is None and seen["length"] == str(len(json_body))
    assert waits and max(waits) < 1.0


def test_a_down_tritonserver_is_a_503():
    async def scenario(s, url, _):
        async with s.get(url + "/v2/health/ready") as r:
            return r.status, await r.json()
    status, body = run(scenario, upstream_up=False)
    assert status == 503 and "retry" in body["error"]


def test_triton_500_for_an_unreadable_body_is_a_400():
    """Issue 49 item 13: Triton answers 500 to `"max_tokens": "5"`, `"seed": -1`, a number
    as `text_input` (checked against the real 24.10 server): the client's mistake."""
    async def scenario(s, url, _):
        async with s.post(url + "/v2/models/llm/unparsable", data=b'{"max_tokens": "5"}') as r:
            assert r.status == 400 and (await r.json())["error"].startswith("Unable to parse 'data'")
        async with s.post(url + "/v2/models/llm/internal", data=b"{}") as r:
            assert r.status == 500 and (await r.json())["error"] == "an internal failure"
    run(scenario)


def test_with_api_keys_v1_routes_need_one_and_the_rest_stay_open():
    """In front of an OpenAI server without keys of its own (Dynamo's frontend): /v1/* needs
    a bearer key, refused before the body is read; /health and /metrics stay open."""
    async def scenario(session, base, _):
        statuses = {}
        for name, headers in [("none", {}), ("wrong", {"Authorization": "Bearer not-the-key"}),
                              ("basic", {"Authorization": "Basic k1"}), ("right", {"Authorization": "Bearer k2"})]:
            async with session.post(base + "/v1/completions", data=b"{}", headers=headers) as r:
                statuses[name] = r.status
                if r.status == 401:
                    assert (await r.json())["error"]["code"] == "invalid_api_key"
        async with session.get(base + "/metrics") as r:
            statuses["metrics"] = r.status
        async with session.get(base + "/v1") as r:
            statuses["v1"] = r.status
        return statuses
    assert run(scenario, api_keys=APIKeys(["k1", "k2"])) == {"none": 401, "wrong": 401, "basic": 401, "right": 201,
                                                             "metrics": 201, "v1": 401}
    # Without keys (Triton's HTTP port) nothing changes.
    async def open_scenario(session, base, _):
        async with session.post(base + "/v1/completions", data=b"{}") as r:
            return r.status
    assert run(open_scenario) == 201


def test_openai_only_passes_v1_and_health_and_nothing_else():
    """In front of Dynamo's frontend, whose other routes (/busy_threshold, ...) take no key."""
    async def scenario(session, base, _):
        statuses = {}
        for method, path in [("POST", "/v1/completions"), ("GET", "/health"), ("GET", "/live"),
                             ("POST", "/busy_threshold"), ("GET", "/metrics"), ("GET", "/openapi.json"),
                             ("GET", "/v1")]:
            async with session.request(method, base + path, data=b"{}" if method == "POST" else None,
                                       headers={"Authorization": "Bearer k"}) as r:
                statuses[path] = r.status
        return statuses
    assert run(scenario, api_keys=APIKeys(["k"]), openai_only=True) == {
        "/v1/completions": 201, "/health": 201, "/live": 201, "/busy_threshold": 404, "/metrics": 404,
        "/openapi.json": 404, "/v1": 404}
