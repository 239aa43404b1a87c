"""The block pool of the paged KV cache: fixed-size blocks, their reference counts, the
free queue (in eviction order) and the prefix cache's hash -> block map. Knows nothing
about requests (kv_cache_manager.py maps requests to blocks)."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Sequence

BlockHash = bytes

@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Set once the block is full and registered in the prefix cache.
    block_hash: Optional[BlockHash] = None
    parent_hash: Optional[BlockHash] = None
    token_ids: tuple[int, ...] = ()
    # Registered, but the step that writes its K/V has not run yet: not a hit.
    pending: bool = False


def hash_block(parent_hash: Optional[BlockHash], token_ids: Sequence[int]) -> BlockHash:
    # A cryptographic hash makes an accidental match of two different prefixes
    # practically impossible; the token check on a hit guards the block itself.
    h = hashlib.sha256(parent_hash or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def hash_chain(parent: Optional[BlockHash], blocks: Iterable[Sequence[int]]) -> Iterator[BlockHash]:
    """The chained hashes of consecutive full blocks after `parent` (a request's cache
    salt before its first block)."""
    for token_ids in blocks:
        parent = hash_block(parent, token_ids)
        yield parent


class BlockPool:
    """The free queue and the hash -> block map. Knows nothing about requests."""

    def __init__(self, num_blocks: int, events=None) -> None:
        """events: a KVEventCollector (backend/engine/kv_events/) told of every eviction
        from the prefix cache; None: no KV events."""
        self.events = events
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the front is reused first.
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self) -> KVBlock:
        _, block = self.free_queue.popitem(last=False)
        self._evict(block)
        block.ref_cnt = 1
        return block

    def touch(self, block: KVBlock) -> None:
        """Take a reference on a block found in the prefix cache."""
        if block.ref_cnt == 0:
            del self.free_queue[block.block_id]
        block.ref_cnt += 1

    def release(self, block: KVBlock) -> None:
        assert block.ref_cnt > 0, f"block {block.block_id} released twice"
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            if block.pending:
                self._evict(block)      # its K/V was never written
            self.free_queue[block.block_id] = block
            if block.block_hash is None:
                # Nothing worth keeping: reuse it before any cached block.
                self.free_queue.move_to_end(block.block_id, last=False)

    def lookup(self, block_hash: BlockHash, parent_hash: Optional[BlockHash],
               token_ids: tuple[int, ...]) -> Optional[KVBlock]:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids or block.parent_hash != parent_hash:
            return None
        return block

    def register(self, block: KVBlock, block_hash: BlockHash, parent_hash: Optional[BlockHash],
                 token_ids: tuple[int, ...], pending: bool = False) -> bool:
        """Whether the block is now in the cache under this hash (False: it was already,
        or another block holds the same content: the first copy is kept)."""
        if block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        block.pending = pending
        self.cached[block_hash] = block
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
            block.block_hash, block.parent_hash, block.token_ids = None, None, ()
        block.pending = False

    def reset_prefix_cache(self) -> None:
        if self.events is not None:
            self.events.clearing(True)          # one AllBlocksCleared for them all
        try:
            for block in list(self.cached.values()):
                self._evict(block)
        finally:
            if self.events is not None:
                self.events.clearing(False)
