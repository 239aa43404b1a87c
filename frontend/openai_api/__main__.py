"""python -m frontend.openai_api [--triton-url localhost:8001] [--host 127.0.0.1] [--port 9000]
[--model-repository model_repository] [--chat-template FILE_OR_TEMPLATE] [--api-key KEY]
[--ssl-certfile F --ssl-keyfile F] [--max-request-body-bytes N]
[--enable-auto-tool-choice --tool-call-parser hermes|llama3_json|mistral|pythonic]
[--reasoning-parser deepseek_r1|qwen3] [--responses-store-size N] [--responses-store-bytes N]"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv=None) -> None:
    from frontend.openai_api.reasoning import REASONING_PARSERS
    from frontend.openai_api.tools.parsers import PARSERS
    ap = argparse.ArgumentParser(description="OpenAI-compatible API in front of tritonserver")
    ap.add_argument("--triton-url", default=os.environ.get("TRITON_GRPC_URL", "localhost:8001"),
                    help="tritonserver's gRPC address")
    ap.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"),
                    help="the address to listen on (HOST; default loopback: 0.0.0.0 exposes the API)")
    ap.add_argument("--port", type=int, default=int(os.environ.get("OPENAI_PORT", "9000")))
    ap.add_argument("--model-repository", help="the repository tritonserver serves (tokenizers, chat templates)")
    ap.add_argument("--chat-template", help="a jinja chat template, or a file holding one (overrides the models')")
    ap.add_argument("--api-key", action="append", default=[],
                    help="a key every /v1 request must send as 'Authorization: Bearer <key>' (repeatable, or "
                         "comma-separated; also API_KEY, and API_KEY_FILE with one key per line)")
    ap.add_argument("--max-request-body-bytes", type=int, default=None,
                    help="larger request bodies get 413 (default 16 MiB)")
    ap.add_argument("--enable-log-requests", action="store_true",
                    help="log each request's prompt, parameters and output (vLLM's flag; off: they are not logged)")
    ap.add_argument("--max-log-len", type=int, default=None,
                    help="with --enable-log-requests: at most this many characters of each prompt and output")
    ap.add_argument("--triton-ssl-root-cert", default=os.environ.get("TRITON_GRPC_ROOT_CERT"),
                    help="tritonserver's gRPC serves TLS (--grpc-use-ssl=true): trust this CA or certificate")
    ap.add_argument("--triton-ssl-target-name", help="the name in tritonserver's certificate, when not the address")
    ap.add_argument("--enable-auto-tool-choice", action="store_true",
                    help="tool_choice 'auto' (the default when tools are sent): the model decides, and "
                         "--tool-call-parser reads its calls (vLLM's flag)")
    ap.add_argument("--tool-call-parser", choices=sorted(PARSERS), help="how the models write tool calls")
    ap.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS),
                    help="split <think> reasoning into reasoning_content (vLLM's flag)")
    ap.add_argument("--responses-store-size", type=int, default=1024,
                    help="/v1/responses replies kept for previous_response_id (oldest dropped; 0: none)")
    ap.add_argument("--responses-store-bytes", type=int, default=None,
                    help="at most this many bytes of /v1/responses replies and their conversations kept "
                         "(oldest dropped; a larger reply is not kept; 0: none; default 64 MiB)")
    ap.add_argument("--allowed-media-domains", default=os.environ.get("ALLOWED_MEDIA_DOMAINS"),
                    help="hosts whose http(s) image URLs the frontend fetches (comma-separated; vLLM's flag); "
                    "without it only inline data: URLs are taken")
    ap.add_argument("--backend-health-url", default=os.environ.get("BACKEND_HEALTH_URL"),
                    help="the supervisor's /ready: while it says the backend cannot serve, requests get a "
                         "503 at once and those waiting end with it (python -m clients.tritonserver sets it)")
    ap.add_argument("--ssl-certfile", help="serve HTTPS with this certificate (uvicorn's)")
    ap.add_argument("--ssl-keyfile", help="the certificate's private key")
    args = ap.parse_args(argv)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        ap.error("--enable-auto-tool-choice needs --tool-call-parser")
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        ap.error("--ssl-certfile and --ssl-keyfile go together")
    if args.max_request_body_bytes is not None and args.max_request_body_bytes < 1:
        ap.error("--max-request-body-bytes must be at least 1")
    import uvicorn
    from backend.engine.host_malloc import map_large_blocks
    from frontend.openai_api.app import DEFAULT_MAX_REQUEST_BODY_BYTES, create_app
    from frontend.openai_api.auth import APIKeys
    from frontend.openai_api.chat import load_template
    from frontend.openai_api.media_fetch import domains_value
    from frontend.openai_api.request_log import RequestLog
    from frontend.openai_api.responses import DEFAULT_RESPONSES_STORE_BYTES
    from frontend.openai_api.tools.choice import ToolConfig
    from frontend.openai_api.triton_client import TritonTLS
    from supervisor.admin_access import KEY_ENV, KEY_FILE_ENV, AdminKeyError, resolve
    try:
        keys = APIKeys.from_sources(args.api_key)
    except OSError as e:
        ap.error(f"API_KEY_FILE: {e}")
    admin_headers = None
    if os.environ.get(KEY_ENV) or os.environ.get(KEY_FILE_ENV):
        try:
            admin_headers = resolve().grpc_headers()
        except AdminKeyError as e:
            ap.error(str(e))
    if not keys and args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("frontend").warning(
            "the OpenAI API listens on %s without an API key: anyone who reaches it can use the model "
            "(set API_KEY or --api-key)", args.host)
    # The frontend's own events (a client gone, tokenizers loaded), one line each.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [frontend] %(message)s"))
    logging.getLogger("frontend").addHandler(handler)
    logging.getLogger("frontend").setLevel(logging.INFO)
    if args.enable_log_requests:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [requests] %(message)s"))
        logging.getLogger("frontend.requests").addHandler(handler)
        logging.getLogger("frontend.requests").setLevel(logging.INFO)
    logging.getLogger("frontend.requests").propagate = False     # its own handler, or silence
    app = create_app(args.triton_url, args.model_repository, load_template(args.chat_template), api_keys=keys,
                     admin_headers=admin_headers,
                     max_request_body_bytes=args.max_request_body_bytes or DEFAULT_MAX_REQUEST_BODY_BYTES,
                     request_log=RequestLog(args.enable_log_requests, args.max_log_len),
                     triton_tls=TritonTLS(args.triton_ssl_root_cert, args.triton_ssl_target_name)
                     if args.triton_ssl_root_cert else None,
                     tool_config=ToolConfig(args.enable_auto_tool_choice, args.tool_call_parser),
                     reasoning_parser=args.reasoning_parser, responses_store_size=args.responses_store_size,
                     allowed_media_domains=domains_value(args.allowed_media_domains),
                     responses_store_bytes=DEFAULT_RESPONSES_STORE_BYTES if args.responses_store_bytes is None
                     else args.responses_store_bytes, backend_health_url=args.backend_health_url)
    # A large body's memory goes back to the system when its request ends (host_malloc.py).
    map_large_blocks()
    # uvicorn's access log names method, path and status: never a prompt or an output.
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", ssl_certfile=args.ssl_certfile,
                ssl_keyfile=args.ssl_keyfile)


if __name__ == "__main__":
    sys.exit(main())
