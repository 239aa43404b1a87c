"""`python -m backend.dynamo_worker --model-repository DIR [--model NAME]`: serve a model
repository entry through NVIDIA Dynamo (its frontend: `python -m dynamo.frontend`).

Dynamo finds its services from the environment, as its own workers do: ETCD_ENDPOINTS
(discovery) and NATS_SERVER (the event plane that carries KV events to its router).

Dynamo's request and event planes take no key, so this worker binds them to loopback
unless `--host` says otherwise (docs/dynamo.md, "Security").
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Optional

from backend.config import ConfigError


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m backend.dynamo_worker", description=__doc__.splitlines()[0])
    p.add_argument("--model-repository", required=True, help="the Triton model repository")
    p.add_argument("--model", default="llm", help="the entry to serve (a folder of the repository)")
    p.add_argument("--served-model-name", default=None, help="the name clients ask for (default: --model)")
    # Defaults from Dynamo's own variables, as its workers read them (its Kubernetes
    # operator sets them in each pod).
    env = os.environ.get
    p.add_argument("--namespace", default=env("DYN_NAMESPACE", "dynamo"),
                   help="Dynamo namespace (the frontend's --namespace; DYN_NAMESPACE)")
    p.add_argument("--component", default=None, help="default: prefill for a prefill worker, else backend")
    p.add_argument("--endpoint", default="generate")
    p.add_argument("--discovery-backend", default=env("DYN_DISCOVERY_BACKEND", "etcd"),
                   choices=("etcd", "file", "mem", "kubernetes"), help="(DYN_DISCOVERY_BACKEND)")
    p.add_argument("--request-plane", default=env("DYN_REQUEST_PLANE", "tcp"), choices=("tcp", "nats"),
                   help="(DYN_REQUEST_PLANE)")
    p.add_argument("--event-plane", default=env("DYN_EVENT_PLANE"), choices=("nats", "zmq"),
                   help="default (DYN_EVENT_PLANE unset): Dynamo's choice for the discovery backend")
    p.add_argument("--disaggregation-mode", default="aggregated", choices=("aggregated", "prefill", "decode"),
                   help="prefill/decode disaggregation (Dynamo's roles): a prefill worker computes prompts and "
                        "hands their KV blocks to a decode worker over NIXL (docs/dynamo.md)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address Dynamo's request and event planes bind and advertise (default: loopback; "
                        "another machine's frontend needs this machine's address, on a trusted network, e.g. a "
                        "pod's $(POD_IP); 'auto': Dynamo's own choice, an address of this machine)")
    return p.parse_args(argv)


LOOPBACK = ("127.0.0.1", "localhost", "::1")
# Dynamo's own variables for where its planes listen (its default is every interface).
HOST_VARIABLES = ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.host != "auto":
        for name in HOST_VARIABLES:
            os.environ.setdefault(name, args.host)
    if args.host in LOOPBACK:
        # NIXL's UCX otherwise listens on every network device too (disaggregation).
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import dynamo.llm  # noqa: F401
    except ImportError:
        print("error: NVIDIA Dynamo is not installed: pip install -r requirements/dynamo.txt "
              "(ai-dynamo and ai-dynamo-runtime, with --no-deps)", file=sys.stderr)
        return 2
    from backend.dynamo_worker.worker import WorkerOptions, serve
    from backend.triton_server.model_entry import read_entry

    model_dir = os.path.join(args.model_repository, args.model)
    try:
        engine_args, _, warnings = read_entry(model_dir)
    except ConfigError as e:
        print(f"error: {model_dir}: {e}", file=sys.stderr)
        return 2
    for warning in warnings:
        logging.warning(warning)
    options = WorkerOptions(served_model_name=args.served_model_name or args.model, namespace=args.namespace,
                            component=args.component or ("prefill" if args.disaggregation_mode == "prefill"
                                                         else "backend"),
                            endpoint=args.endpoint, discovery_backend=args.discovery_backend,
                            request_plane=args.request_plane, event_plane=args.event_plane,
                            disaggregation_mode=args.disaggregation_mode, on_loopback=args.host in LOOPBACK)

    async def run() -> None:
        task = asyncio.current_task()
        aloop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            aloop.add_signal_handler(sig, task.cancel)
        await serve(engine_args, engine_args.model, options)

    try:
        asyncio.run(run())
    except asyncio.CancelledError:
        pass
    except (ConfigError, ValueError) as e:       # (ValueError: a role this engine cannot play)
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
