"""The host-memory KV tier's scheduler side (vLLM's native CPU offloading, our way): an
index of the full blocks kept in a bounded pool of host slots, least recently used out
first.

Write-through: every full block a step computes is copied to a host slot once (a block
already there only counts as used). So a block evicted from the device's prefix cache is
still on the host. A later request whose prefix runs past the device's hits finds the
next blocks here, and they are copied back into fresh device blocks in its first step,
not recomputed. Blocks are matched as on the device: by the chained hash, then the
parent hash and the token ids themselves.

The copies run in the runner (host_cache.py), in the order `take_transfers` gives: saves,
then loads, both before the forward. A save records its slot at once. A lookup in the
next schedule may then load from that slot, and the load runs after the save.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

from backend.config import ConfigError
from backend.engine.kv_events.collector import HOST
from backend.engine.kv_offload.connector import ExternalHit, KVConnectorScheduler, KVTransfers


def num_host_slots(size_gib: float, bytes_per_block: int) -> int:
    """Blocks of every layer's K and V that `size_gib` holds (kv_offloading_size)."""
    slots = int(size_gib * 2**30) // bytes_per_block
    if slots < 1:
        raise ConfigError(f"invalid engine argument 'kv_offloading_size': {size_gib} GiB holds no block "
                          f"({bytes_per_block} bytes each)")
    return slots


class HostBlockIndex:
    """hash -> host slot, bounded, least recently used evicted first; each slot's
    (parent hash, token ids) for the check on a hit."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()     # LRU first
        self._entry: dict[int, tuple[bytes, Optional[bytes], tuple[int, ...]]] = {}
        self._free = list(range(num_slots - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slot_of

    def find(self, block_hash: bytes, parent: Optional[bytes], token_ids: tuple[int, ...]) -> Optional[int]:
        slot = self._slot_of.get(block_hash)
        if slot is None:
            return None
        _, have_parent, have_tokens = self._entry[slot]
        if have_parent != parent or have_tokens != token_ids:
            return None
        self._slot_of.move_to_end(block_hash)
        return slot

    def insert(self, block_hash: bytes, parent: Optional[bytes], token_ids: tuple[int, ...],
               pinned: set[int]) -> tuple[Optional[int], Optional[bytes]]:
        """(a slot for the block, the hash evicted from it): the least recently used
        slot's when the pool is full, but never a pinned one; (None, None) when every
        slot is pinned."""
        victim = None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._slot_of.items() if s not in pinned), None)
            if victim is None:
                return None, None
            slot = self._slot_of.pop(victim)
        self._slot_of[block_hash] = slot
        self._entry[slot] = (block_hash, parent, token_ids)
        return slot, victim

    def touch(self, block_hash: bytes) -> None:
        self._slot_of.move_to_end(block_hash)


class HostOffloadScheduler(KVConnectorScheduler):
    def __init__(self, num_slots: int, block_size: int, events=None) -> None:
        """events: a KVEventCollector (backend/engine/kv_events/): blocks kept and evicted
        here, medium "CPU"."""
        self.index = HostBlockIndex(num_slots)
        self.block_size = block_size
        self.events = events
        self._transfers = KVTransfers()
        self._pinned: set[int] = set()          # slots the recorded loads read
        self._saving: set[int] = set()          # device blocks the recorded saves read
        self.num_hit_blocks = 0                 # blocks loaded instead of recomputed
        self.num_saved_blocks = 0

    def lookup(self, request, start: int, stop: int) -> list[ExternalHit]:
        hits = []
        hashes, bs = request.block_hashes, self.block_size
        for i in range(start, stop):
            parent = hashes[i - 1] if i else request.cache_salt
            slot = self.index.find(hashes[i], parent, tuple(request.token_slice(i * bs, (i + 1) * bs)))
            if slot is None:
                break
            hits.append(ExternalHit(slot, hashes[i]))
        return hits

    def on_allocated(self, hits: Sequence[ExternalHit], blocks) -> None:
        for hit, block in zip(hits, blocks):
            self._transfers.loads.append((hit.location, block.block_id))
            self._pinned.add(hit.location)
        self.num_hit_blocks += len(hits)

    def on_computed(self, blocks, first_index: int = 1) -> None:
        for i, block in enumerate(blocks, start=first_index):
            if block.block_hash is None:
                continue
            if block.block_hash in self.index:
                self.index.touch(block.block_hash)
                continue
            slot, evicted = self.index.insert(block.block_hash, block.parent_hash, block.token_ids, self._pinned)
            if slot is None:
                continue                        # every slot is being read in this step: not kept
            if self.events is not None:
                if evicted is not None:
                    self.events.removed(evicted, HOST)
                self.events.stored([block.block_hash], block.parent_hash if i else None, list(block.token_ids), HOST)
            self._transfers.saves.append((block.block_id, slot))
            self._saving.add(block.block_id)
            self.num_saved_blocks += 1

    def on_reused(self, block) -> None:
        if block.block_id in self._saving:
            self._transfers.wait_for_saves = True

    def reset(self) -> None:
        """Saves recorded still run (their slots are simply forgotten)."""
        self.index = HostBlockIndex(self.index.num_slots)
        self._pinned.clear()

    @property
    def num_pending_saves(self) -> int:
        """Saves recorded for the next step that runs (none has run since they were)."""
        return len(self._transfers.saves)

    def take_transfers(self) -> Optional[KVTransfers]:
        transfers, self._transfers = self._transfers, KVTransfers()
        self._pinned.clear()
        self._saving.clear()
        return transfers if transfers else None

    def stats(self) -> dict:
        return {"kv_offload_host_blocks": self.index.num_slots, "kv_offload_host_blocks_used": len(self.index),
                "kv_offload_hit_blocks": self.num_hit_blocks, "kv_offload_saved_blocks": self.num_saved_blocks}
