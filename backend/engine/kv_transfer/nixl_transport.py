"""KV blocks between two engines' pools over NIXL (NVIDIA's inference transfer library,
UCX underneath): host memory on CPU, device memory on CUDA, as vLLM's NixlConnector
moves them.

Each engine's agent registers its paged cache, every layer's K and V tensor
([num_blocks, block_size, heads, head_dim], so a block is one contiguous range). The
side that computed the blocks publishes a descriptor (agent metadata, the tensors'
base addresses, a block's bytes, the layout); the side that needs them READs blocks by
id into blocks of its own, one descriptor per tensor and block, then tells the owner
(a notification) that it may let them go.

`nixl-cu12` is an optional dependency (requirements/dynamo.txt), imported here only.
"""

from __future__ import annotations

import base64
import threading
import time
from typing import Sequence

import numpy as np

from backend.attention.metadata import KVCacheLayer


class TransferError(RuntimeError):
    """A copy that failed or did not finish in time: the caller computes the prompt itself.
    `blocks_reusable` is False when the copy could not be stopped: it may still write
    the local blocks, so they must not go back to the pool."""

    def __init__(self, message: str, blocks_reusable: bool = True) -> None:
        super().__init__(message)
        self.blocks_reusable = blocks_reusable


def _nixl():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


class NixlTransport:
    """Thread-safe: every call into the agent holds one lock (the agent is not made for
    concurrent callers), never across a copy's wait."""

    def __init__(self, name: str, kv_layers: Sequence[KVCacheLayer]) -> None:
        nixl_agent, nixl_agent_config = _nixl()
        self.name = name
        self._lock = threading.Lock()
        self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        self.tensors = [t for layer in kv_layers for t in (layer.key, layer.value)]
        first = self.tensors[0]
        self.mem_type = "VRAM" if first.is_cuda else "DRAM"
        self.device_id = first.device.index or 0
        self.block_bytes = first[0].numel() * first.element_size()
        self.bases = [t.data_ptr() for t in self.tensors]
        # What must be equal on both sides for a block to mean the same bytes.
        self.layout = f"{len(self.tensors)}x{list(first.shape[1:])}:{first.dtype}"
        self._registered = self.agent.register_memory(self.tensors)
        self._remotes: dict[str, str] = {}          # engine id -> the agent name NIXL gave it
        self._descriptor = {"engine_id": name, "bases": self.bases, "block_bytes": self.block_bytes,
                            "layout": self.layout, "mem_type": self.mem_type, "device_id": self.device_id,
                            "agent_metadata": base64.b64encode(self.agent.get_agent_metadata()).decode()}

    def descriptor(self) -> dict:
        """What a reader of this engine's blocks needs (JSON-safe; the same every time)."""
        return dict(self._descriptor)

    def _remote_agent(self, remote: dict) -> str:
        """The remote engine's agent, added once (a dead engine's stays: an engine that
        restarts has a new id, and removing one under a copy in flight is unsafe)."""
        engine_id = remote["engine_id"]
        with self._lock:
            if engine_id not in self._remotes:
                self._remotes[engine_id] = self.agent.add_remote_agent(base64.b64decode(remote["agent_metadata"]))
            return self._remotes[engine_id]

    def _descs(self, bases: Sequence[int], block_ids: Sequence[int], device_id: int, mem_type: str):
        ids = np.asarray(block_ids, dtype=np.int64)
        rows = np.empty((len(bases) * len(ids), 3), dtype=np.int64)
        rows[:, 0] = (np.asarray(bases, dtype=np.int64)[:, None] + ids[None, :] * self.block_bytes).reshape(-1)
        rows[:, 1] = self.block_bytes
        rows[:, 2] = device_id
        return self.agent.get_xfer_descs(rows, mem_type)

    def read(self, remote: dict, remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
             timeout_s: float, notification: bytes = b"") -> None:
        """Copy the remote engine's blocks into ours (same order); the owner gets
        `notification` when it is done. Raises TransferError."""
        if remote.get("layout") != self.layout or remote.get("block_bytes") != self.block_bytes:
            raise TransferError(f"the remote cache's layout {remote.get('layout')} is not ours ({self.layout})")
        if len(remote_block_ids) != len(local_block_ids):
            raise TransferError("as many remote blocks as local ones are needed")
        if not local_block_ids:
            return
        try:
            agent = self._remote_agent(remote)
            with self._lock:
                handle = self.agent.initialize_xfer(
                    "READ", self._descs(self.bases, local_block_ids, self.device_id, self.mem_type),
                    self._descs(remote["bases"], remote_block_ids, remote["device_id"], remote["mem_type"]),
                    agent, notification)
        except Exception as e:          # (NIXL raises its own types: an unreachable agent among them)
            raise TransferError(f"NIXL could not start the copy from {remote.get('engine_id')}: {e}") from e
        problem, started = None, False
        try:
            with self._lock:
                state = self.agent.transfer(handle)
            started = True
            deadline = time.monotonic() + timeout_s
            wait = 0.0002
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    problem = f"the copy from {remote['engine_id']} took longer than {timeout_s} s"
                    break
                time.sleep(wait)
                wait = min(wait * 2, 0.005)     # (short copies finish in the first waits)
                with self._lock:
                    state = self.agent.check_xfer_state(handle)
            if state == "ERR":
                problem = f"NIXL reported an error copying from {remote['engine_id']}"
        except Exception as e:
            problem = f"NIXL failed copying from {remote['engine_id']}: {e}"
        try:
            with self._lock:
                self.agent.release_xfer_handle(handle)      # (cancels a copy still running, where it can)
        except Exception as e:
            if problem is None:
                return                  # done; only the handle's release failed
            raise TransferError(f"{problem}; and it could not be stopped ({e})", blocks_reusable=not started) from e
        if problem is not None:
            raise TransferError(problem)

    def notify(self, remote: dict, message: bytes) -> bool:
        """A message to the remote engine's agent (False if it cannot be sent)."""
        try:
            agent = self._remote_agent(remote)
            with self._lock:
                self.agent.send_notif(agent, message)
            return True
        except Exception:
            return False

    def notifications(self) -> list[bytes]:
        """Messages other agents sent since the last call (transfer notifications too)."""
        with self._lock:
            found = self.agent.get_new_notifs()
        return [m for messages in found.values() for m in messages]
