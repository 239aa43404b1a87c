"""A worker node's headless command: joins the head's rendezvous and serves its ranks.

    python -m backend.parallel.node --master-addr HEAD --master-port 29500 --node-rank 1 [--nnodes 2]

Each option defaults to the standard variable torchrun and LeaderWorkerSet deployments set
(MASTER_ADDR, MASTER_PORT, NODE_RANK, NNODES); WORLD_SIZE, when set, must equal the head's
world size (tensor_parallel_size x pipeline_parallel_size). The head (the engine, in
tritonserver) publishes everything else in the store: model, sizes, dtypes, so the two
cannot disagree. This process starts the node's ranks (backend/parallel/rank.py), beats
a heartbeat for the head (backend/parallel/nodes.py), and when one of its ranks exits
with an error, records why for the head, stops the others and exits 1; when they all
exit cleanly (the head stopped them), it exits 0. It gives up when the head does not
answer within --join-timeout-s, or its store goes away (the head's ranks then fail too).
It never rejoins by itself: run it under a restart policy (LeaderWorkerSet restarts the
whole group, deploy/k8s/leaderworkerset.yaml), so a head that reloads the model finds it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import signal
import sys
import time
from typing import Optional

import torch.distributed as dist

from backend.parallel.nodes import HEARTBEAT_S, SPEC_KEY, dead_key, describe, heartbeat_key, joined_key, node_ranks
from backend.parallel.rank_spec import WorkerSpec
from backend.parallel.workers import start_ranks

logger = logging.getLogger("paged_llm.node")


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"environment variable {name}={value!r} is not an integer") from None


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m backend.parallel.node", description=__doc__.split("\n")[0])
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR"), help="the head's address (MASTER_ADDR)")
    p.add_argument("--master-port", type=int, default=_env_int("MASTER_PORT") or 29500,
                   help="the head's rendezvous port (MASTER_PORT; default 29500)")
    p.add_argument("--node-rank", type=int, default=_env_int("NODE_RANK"), help="this node, 1..nnodes-1 (NODE_RANK)")
    p.add_argument("--nnodes", type=int, default=_env_int("NNODES"), help="checked against the head's (NNODES)")
    p.add_argument("--join-timeout-s", type=float, default=600.0, help="how long to wait for the head")
    args = p.parse_args(argv)
    if not args.master_addr:
        p.error("--master-addr (or MASTER_ADDR) is required")
    if args.node_rank is None or args.node_rank < 1:
        p.error(f"--node-rank (or NODE_RANK) must be 1 or more on a worker node (0 is the head), not {args.node_rank}")
    return args


def read_spec(store: dist.Store, args: argparse.Namespace) -> WorkerSpec:
    spec = WorkerSpec(**json.loads(store.get(SPEC_KEY).decode()))
    if args.nnodes is not None and args.nnodes != spec.nnodes:
        raise SystemExit(f"--nnodes/NNODES is {args.nnodes} but the head runs nnodes={spec.nnodes}")
    if args.node_rank >= spec.nnodes:
        raise SystemExit(f"--node-rank/NODE_RANK is {args.node_rank} but the head runs nnodes={spec.nnodes}")
    world = _env_int("WORLD_SIZE")
    if world is not None and world != spec.size:
        raise SystemExit(f"WORLD_SIZE is {world} but the head's world size is {spec.size} "
                         f"(tensor_parallel_size x pipeline_parallel_size)")
    # The head's address as this node reaches it.
    return dataclasses.replace(spec, master_addr=args.master_addr, master_port=args.master_port)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    node = args.node_rank
    logging.basicConfig(level=logging.INFO, format=f"[paged_llm node {node}] %(message)s")
    try:
        store = dist.TCPStore(args.master_addr, args.master_port, None, False,
                              datetime.timedelta(seconds=args.join_timeout_s))
        spec = read_spec(store, args)
    except (RuntimeError, dist.DistStoreError) as e:
        logger.error("no head at %s:%d within %g s: %s", args.master_addr, args.master_port, args.join_timeout_s, e)
        return 1
    ranks = node_ranks(node, spec.ranks_per_node)
    logger.info("joining as %s of %d nodes", describe(node, spec.ranks_per_node), spec.nnodes)
    store.set(joined_key(node), "1")
    procs = start_ranks(spec, ranks)

    def stop(signum, frame) -> None:        # SIGTERM (pod deletion): take the ranks down too
        for p in procs:
            p.kill()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        while True:
            failed = [(r, p) for r, p in zip(ranks, procs) if p.exitcode not in (None, 0)]
            if failed:
                why = "; ".join(f"rank {r} (pid {p.pid}) exited with code {p.exitcode}" for r, p in failed)
                logger.error("%s: stopping this node's ranks", why)
                store.set(dead_key(node), why)
                return 1
            if all(p.exitcode == 0 for p in procs):     # the head stopped them (its store may be gone)
                logger.info("every rank stopped: done")
                return 0
            store.add(heartbeat_key(node), 1)
            time.sleep(HEARTBEAT_S)
    except (RuntimeError, dist.DistStoreError) as e:    # the head's store is gone
        logger.error("lost the head at %s:%d: %s", args.master_addr, args.master_port, e)
        return 1
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


if __name__ == "__main__":
    raise SystemExit(main())
