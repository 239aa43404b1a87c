"""The engine thread's side of KV events: the block pool and the host tier report what
they cache and evict here, as plain tuples (no encoding, no I/O on the engine thread),
and each step's events go to the publisher in one batch.

A stored event carries a run of blocks of one request, chained: their hashes (the pool's
own chained SHA-256, the same on every replica of the same model and settings), the
parent of the first (None at the start of a prompt: for a LoRA adapter the chain's root
is the adapter's salt, which is in every hash already), their token ids and the block
size, and for an adapter's blocks `lora_id`: a 63-bit number from the adapter's salt
(its name and files), the same on every replica. `medium` says which tier: "GPU" for
the device pool (vLLM's name for it, on a CPU engine too) and "CPU" for the host tier
(kv_offload/host_tier.py).
"""

from __future__ import annotations

from typing import Optional

DEVICE, HOST = "GPU", "CPU"


def lora_id(salt: Optional[bytes]) -> Optional[int]:
    """An adapter's id in KV events: from its cache salt (the same on every replica)."""
    return int.from_bytes(salt[:8], "big") >> 1 if salt else None


class KVEventCollector:
    def __init__(self, block_size: int, publisher) -> None:
        """publisher: `publish(events)` takes a step's batch without blocking, `close()`
        sends what is queued and stops (publisher.py)."""
        self.block_size = block_size
        self.publisher = publisher
        self._events: list[tuple] = []
        self._clearing = False

    def stored(self, block_hashes: list[bytes], parent: Optional[bytes], token_ids: list[int],
               medium: str = DEVICE, lora_id: Optional[int] = None) -> None:
        if block_hashes:
            self._events.append(("stored", block_hashes, parent, token_ids, medium, lora_id))

    def removed(self, block_hash: bytes, medium: str = DEVICE) -> None:
        if self._clearing:
            return
        last = self._events[-1] if self._events else None
        if last is not None and last[0] == "removed" and last[2] == medium:
            last[1].append(block_hash)          # one event for a step's run of evictions
        else:
            self._events.append(("removed", [block_hash], medium))

    @staticmethod
    def lora_id(request) -> Optional[int]:
        return lora_id(request.cache_salt) if request.sampling_params.lora_name else None

    def clearing(self, on: bool) -> None:
        """Between clearing(True) and clearing(False) the pool empties its cache: one
        AllBlocksCleared stands for every removal."""
        if on:
            self._events.append(("cleared",))
        self._clearing = on

    def flush(self) -> None:
        """After a step: its events, if any, to the publisher."""
        if self._events:
            events, self._events = self._events, []
            self.publisher.publish(events)

    def shutdown(self) -> None:
        self.flush()
        self.publisher.close()
