"""A validating front for tritonserver's HTTP port: what a client may send is checked here,
before Triton's own HTTP server parses it.

    python -m frontend.http_guard --listen 0.0.0.0:8000 --upstream 127.0.0.1:18000

Why: Triton 24.10's HTTP server (the release the pytriton wheel carries, and the newest on
PyPI) crashes on a chunked body of many small chunks and on a deeply nested JSON body
(CVE-2025-23310, CVE-2025-23311; fixed from 25.07 on: the image uses 25.08). Inference needs no key, so anyone who
reaches the port could crash the server, again and again. `make serve` runs this guard in
front of Triton's HTTP port whenever that port is not on loopback (`--http-guard auto`),
with tritonserver itself on a loopback port behind it.

What it does to each request:
 - the body is read whole by aiohttp's parser, chunked or not, gzip or deflate unpacked
   (any other Content-Encoding is a 415), and refused with 413 past `--max-body-bytes`
   (16 MiB, counted unpacked: no zip bomb reaches Triton) before more is read; Triton
   receives it plain, with a Content-Length, never chunked or compressed;
 - its JSON is refused with 400 when it nests more than 128 levels, measured in linear
   time, in a thread for a large body, before anything parses it
   (frontend/openai_api/json_depth.py). That is the whole
   body, except on `/infer`, where Triton's binary tensor extension takes only the part
   `Inference-Header-Content-Length` names as JSON (Triton honours that header there
   alone); a header this check depends on, sent twice, is a 400;
 - everything else (method, path, query, headers such as the admin key) goes to Triton
   as sent, and Triton's answer, streamed or not, comes back as Triton sent it; except
   Triton's 500 for a body it cannot read as its protocol ("Unable to parse ...": a
   string as `max_tokens`, a negative `seed`), which is the client's mistake: a 400.
While tritonserver is down (a restart) requests get 503.

The same guard fronts another OpenAI-compatible server that takes no key of its own
(NVIDIA Dynamo's frontend: docs/dynamo.md): with `--api-key` (or API_KEY, API_KEY_FILE)
every `/v1/*` route needs `Authorization: Bearer <key>`, as our OpenAI frontend's do
(frontend/openai_api/auth.py); a request without one gets 401 and never reaches it.
`--openai-only` passes nothing but `/v1/*`, `/health` and `/live` (a 404 for the rest).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from typing import Optional

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web
from multidict import CIMultiDict

from backend.engine.host_malloc import map_large_blocks
from frontend.openai_api.auth import APIKeys, protected
from frontend.openai_api.json_depth import MAX_JSON_DEPTH, nests_too_deep

log = logging.getLogger("http_guard")
DEFAULT_MAX_BODY_BYTES = 16 << 20
SESSION = web.AppKey("session", ClientSession)
BINARY_HEADER = "Inference-Header-Content-Length"    # Triton's binary tensor data extension
# Where Triton reads the binary tensor extension: KServe's infer route, nowhere else
# (/generate and /generate_stream parse the whole body as JSON).
_INFER_PATH = re.compile(r"^/v2/models/[^/]+(/versions/[^/]+)?/infer$")
# Hop-by-hop headers (RFC 9110 7.6.1), and the framing and coding this proxy sets itself
# (the body goes on unpacked: aiohttp's parser has undone gzip and deflate).
_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
        "transfer-encoding", "upgrade", "host", "content-length", "content-encoding", "expect"}
# Triton's answer keeps its own coding (Accept-Encoding goes through): its bytes pass as sent.
_RESPONSE_HOP = _HOP - {"content-encoding"}
# How Triton's HTTP server words a request body it could not read as JSON of its protocol.
_UNPARSABLE = re.compile(rb'\s*\{\s*"error"\s*:\s*"Unable to parse ')
_CODINGS = {"", "identity", "gzip", "deflate", "x-gzip"}      # what aiohttp unpacks and Triton takes
# Headers whose value decides what is checked: one each, or the request is refused.
_SINGLE = (BINARY_HEADER, "Content-Encoding", "Content-Length")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)     # Triton's error body


async def _read_body(request: web.Request, limit: int) -> Optional[bytes]:
    """The whole body, or None once it passes `limit` (declared or counted)."""
    if request.content_length is not None and request.content_length > limit:
        return None
    body = bytearray()
    while chunk := await request.content.readany():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def _header_problem(request: web.Request) -> Optional[tuple[int, str]]:
    for name in _SINGLE:
        if len(request.headers.getall(name, [])) > 1:
            return 400, f"the header {name} is sent more than once"
    coding = request.headers.get("Content-Encoding", "").strip().lower()
    if coding not in _CODINGS:
        return 415, f"Content-Encoding '{coding}' is not accepted (gzip, deflate or none)"
    return None


def _json_part(request: web.Request, body: bytes) -> bytes | str:
    """The JSON Triton will parse: the whole body, or on /infer its binary-extension header
    part. A str is an error message."""
    declared = request.headers.get(BINARY_HEADER)
    if declared is None or not _INFER_PATH.match(request.path):
        return body
    if not (declared.isascii() and declared.isdigit()) or int(declared) > len(body):
        return f"{BINARY_HEADER} must be a length within the body's {len(body)} bytes"
    return body[:int(declared)]


# With --openai-only, the only paths besides /v1/* (keyed) that reach the upstream.
OPEN_PATHS = ("/health", "/live")


def make_app(upstream: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
             api_keys: APIKeys = APIKeys(), openai_only: bool = False) -> web.Application:
    base = f"http://{upstream}"

    async def proxy(request: web.Request) -> web.StreamResponse:
        if openai_only and not (request.path.startswith("/v1/") or request.path in OPEN_PATHS):
            # (Dynamo's frontend also serves unkeyed control routes, /busy_threshold among them)
            return web.json_response({"error": {"message": f"not found: {request.path} (this port serves the "
                                                           "OpenAI API under /v1/, and /health)",
                                                "type": "invalid_request_error", "code": "not_found"}}, status=404)
        if api_keys and protected(request.path) and not api_keys.allows(request.headers.get("Authorization")):
            # (before the body is read: a keyless client costs nothing more)
            return web.json_response({"error": {"message": "missing or invalid API key (Authorization: Bearer)",
                                                "type": "invalid_request_error", "code": "invalid_api_key"}},
                                     status=401)
        problem = _header_problem(request)
        if problem is not None:
            return _error(*problem)
        body = await _read_body(request, max_body_bytes)
        if body is None:
            return _error(413, f"the request body is larger than {max_body_bytes} bytes (the HTTP guard's "
                               "--max-body-bytes)")
        part = _json_part(request, body)
        if isinstance(part, str):
            return _error(400, part)
        if part and await nests_too_deep(part):
            return _error(400, f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep")
        # Every value of every other header, in order (a dict would keep one of each).
        headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in _HOP)
        session = request.app[SESSION]
        response: Optional[web.StreamResponse] = None
        try:
            async with session.request(request.method, base + request.rel_url.raw_path_qs, headers=headers,
                                       data=body if body or request.can_read_body else None) as up:
                if up.status == 500:
                    return await _client_error_or_500(up)
                response = web.StreamResponse(status=up.status, reason=up.reason)
                for k, v in up.headers.items():
                    if k.lower() not in _RESPONSE_HOP:
                        response.headers.add(k, v)
                if up.content_length is not None:
                    response.content_length = up.content_length
                await response.prepare(request)
                async for chunk in up.content.iter_any():   # server-sent events as they come
                    await response.write(chunk)
                await response.write_eof()
                return response
        except (ClientError, ConnectionResetError, BrokenPipeError) as e:
            # Leaving the `async with` has closed Triton's side of the stream.
            if response is not None and response.prepared:
                if request.transport is None or request.transport.is_closing():
                    # The client left mid-answer (a write to it failed): routine, one debug
                    # line (aiohttp logged a traceback for each, a flood under load).
                    log.debug("client left mid-answer: %s %s", request.method, request.path)
                    return response
                raise                       # Triton cut the answer: the client sees the cut too
            if not isinstance(e, ClientError):
                raise
            log.warning("tritonserver unreachable: %s", e)
            return _error(503, "tritonserver is not reachable (starting or restarting); retry")

    async def _client_error_or_500(up) -> web.Response:
        """Triton answers 500 to a body it cannot read as its request (`"max_tokens": "5"`,
        `"seed": -1`, a number as `text_input`: "Unable to parse ..."): the client's mistake,
        so a 400 with Triton's words. Other 500s pass as they are."""
        text = await up.read()          # an error answer: small
        status = 400 if _UNPARSABLE.match(text) else 500
        return web.Response(status=status, body=text, content_type=up.content_type or "application/json")

    async def open_session(app: web.Application) -> None:
        # No read timeout: a stream may run as long as generation does. No decompression:
        # bytes go back as Triton sent them, Content-Encoding included. No idle connection
        # kept to Triton (one loopback connect per request): Triton's shutdown waits for
        # every open HTTP connection, an idle pooled one too, up to its exit timeout (30 s
        # of every stop, before).
        app[SESSION] = ClientSession(connector=TCPConnector(limit=1024, force_close=True), auto_decompress=False,
                                       timeout=ClientTimeout(total=None, connect=5, sock_read=None))

    async def close_session(app: web.Application) -> None:
        await app[SESSION].close()

    # client_max_size is aiohttp's own bound on request.read(); ours is counted above.
    app = web.Application(client_max_size=max_body_bytes)
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m frontend.http_guard", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", required=True, help="HOST:PORT clients reach (e.g. 0.0.0.0:8000)")
    ap.add_argument("--upstream", required=True, help="the server's HTTP HOST:PORT, on loopback")
    ap.add_argument("--api-key", action="append", default=None,
                    help="keys /v1/* routes need (repeatable; also API_KEY, API_KEY_FILE); "
                         "for an OpenAI server without keys of its own, such as Dynamo's frontend")
    ap.add_argument("--openai-only", action="store_true",
                    help="pass only /v1/* and /health, /live (404 for anything else): in front of a server whose "
                         "other routes take no key, such as Dynamo's frontend")
    ap.add_argument("--max-body-bytes", type=int,
                    default=int(os.environ.get("HTTP_GUARD_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES)),
                    help="larger request bodies get 413 (default 16 MiB; HTTP_GUARD_MAX_BODY_BYTES)")
    args = ap.parse_args(argv)
    if args.max_body_bytes < 1:
        ap.error("--max-body-bytes must be at least 1")
    host, _, port = args.listen.rpartition(":")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [http-guard] %(levelname)s %(message)s")
    keys = APIKeys.from_sources(args.api_key)
    map_large_blocks()          # a body's memory goes back to the system when its request ends (host_malloc.py)
    web.run_app(make_app(args.upstream, args.max_body_bytes, keys, args.openai_only), host=host.strip("[]") or "0.0.0.0", port=int(port),
                access_log=None, print=None, shutdown_timeout=5.0)


if __name__ == "__main__":
    main()
