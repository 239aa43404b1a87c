"""Worker nodes as rank 0 sees them, through the rendezvous store it serves.

Node n (1..nnodes-1) runs the ranks [n * k, (n + 1) * k) (k = world size / nnodes) under
an agent (`python -m backend.parallel.node`, backend/parallel/node.py). The head
publishes the ranks' spec in the store; each agent reads it, marks itself joined, starts
its ranks and then adds to a heartbeat counter every HEARTBEAT_S. An agent whose rank
exits writes why under its `dead` key. Rank 0 reads these keys (at most every
CHECK_EVERY_S, from check_health, busy or idle): a `dead` key, or a counter that stopped
moving for health_timeout_s, fails the engine with a message naming the node and its
ranks. A node's clock is never compared with the head's: only whether its counter moved.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time

import torch.distributed as dist

HEARTBEAT_S = 0.5
CHECK_EVERY_S = 0.2
SPEC_KEY = "paged_llm/spec"


def joined_key(node: int) -> str:
    return f"paged_llm/node{node}/joined"


def heartbeat_key(node: int) -> str:
    return f"paged_llm/node{node}/heartbeat"


def dead_key(node: int) -> str:
    return f"paged_llm/node{node}/dead"


def node_ranks(node: int, ranks_per_node: int) -> range:
    return range(node * ranks_per_node, (node + 1) * ranks_per_node)


def describe(node: int, ranks_per_node: int) -> str:
    ranks = node_ranks(node, ranks_per_node)
    return f"worker node {node} ({f'ranks {ranks[0]}-{ranks[-1]}' if len(ranks) > 1 else f'rank {ranks[0]}'})"


class WorkerNodes:
    """Publishes the spec for the agents, and tells which node is late or gone."""

    def __init__(self, spec) -> None:
        # A connection of its own to the store rank 0 serves: the rendezvous blocks the
        # process group's connection while it waits for the ranks.
        self.store = dist.TCPStore("127.0.0.1", spec.master_port, None, False,
                                   datetime.timedelta(seconds=spec.join_timeout_s))
        store = self.store
        self.nnodes = spec.nnodes
        self.ranks_per_node = spec.ranks_per_node
        self.health_timeout_s = spec.node_health_timeout_s
        self.address = f"{spec.master_addr}:{spec.master_port}"
        store.set(SPEC_KEY, json.dumps(dataclasses.asdict(spec), default=str))
        # Per node: its last heartbeat count and when (head clock) it last moved.
        self._beats: dict[int, tuple[int, float]] = {}
        self._checked_at = 0.0
        self._verdict = ""

    def not_joined(self, timeout_s: float) -> str:
        late = [describe(n, self.ranks_per_node) for n in range(1, self.nnodes)
                if not self.store.check([joined_key(n)])]
        if not late:
            return ""
        return (f"{', '.join(late)} did not join within {timeout_s:g} s (node_join_timeout_s): start `python -m "
                f"backend.parallel.node --master-addr <this host> --master-port {self.address.rsplit(':', 1)[1]} "
                f"--node-rank <node>` there")

    def dead(self) -> str:
        """Why a node is gone ('' while all are well). Cheap: the store is read at most
        every CHECK_EVERY_S; a node that has not joined yet is the join timeout's matter."""
        now = time.monotonic()
        if self._verdict or now - self._checked_at < CHECK_EVERY_S:
            return self._verdict
        self._checked_at = now
        for n in range(1, self.nnodes):
            if self.store.check([dead_key(n)]):
                self._verdict = f"{describe(n, self.ranks_per_node)}: {self.store.get(dead_key(n)).decode()}"
                break
            if not self.store.check([heartbeat_key(n)]):
                continue
            count = self.store.add(heartbeat_key(n), 0)
            last = self._beats.get(n)
            if last is None or count != last[0]:
                self._beats[n] = (count, now)
            elif now - last[1] > self.health_timeout_s:
                self._verdict = (f"{describe(n, self.ranks_per_node)} stopped answering: no heartbeat for "
                                 f"{now - last[1]:.1f} s (node_health_timeout_s={self.health_timeout_s:g})")
                break
        return self._verdict
