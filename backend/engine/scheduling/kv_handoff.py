"""KV blocks handed from one engine to another: prefill/decode disaggregation.

The prefill side: a request whose `kv_transfer_params` ask for `do_remote_decode` keeps
its computed full blocks when it finishes (`hold`), so a decode engine can read them;
they go back to the pool when that engine says it has (`release`) or after
`timeout_s` (a decode engine that died never says).

The decode side: a prompt's blocks are brought in before its request is added
(`reserve_import`, the transport's copy, then `commit_import`). The blocks it already
has cached are not asked for; the others are allocated, filled by the transport, then
registered in the prefix cache as computed. The request is then an ordinary one whose
prompt hits the prefix cache: chunked prefill, preemption and every other feature work
as for any hit, and a block evicted before the request is admitted is recomputed. A
failed copy gives its blocks back unregistered (`abort_import`): the request computes
its prompt here.

Runs on the engine thread (the one writer of KV state); the copies themselves run
elsewhere, into blocks nothing else references.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from backend.engine.request import Request
from backend.engine.scheduling.block_pool import BlockHash, KVBlock, hash_chain
from backend.engine.scheduling.kv_cache_manager import KVCacheManager

DEFAULT_TIMEOUT_S = 60.0


@dataclass
class ImportTicket:
    """The decode side's reservation for one prompt: its first `num_cached` full blocks
    were cached here already; `blocks` are allocated for the next ones, to be filled
    from the remote blocks of the same indices."""
    num_cached: int
    blocks: list[KVBlock]
    hashes: list[BlockHash]
    parents: list[Optional[BlockHash]]
    token_ids: list[tuple[int, ...]]
    lora_id: Optional[int] = None           # (KV events: the adapter the blocks belong to)
    # The cached run's blocks, referenced until the ticket ends so that allocating the
    # others cannot evict them; and on CUDA an event the copy waits for (a step still
    # in flight may write a block that was just freed and reserved here).
    pinned: list[KVBlock] = field(default_factory=list)
    ready: Optional[Any] = None

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


@dataclass
class _Held:
    blocks: list[KVBlock]
    deadline: float


@dataclass
class KVHandoff:
    kv_cache: KVCacheManager
    timeout_s: float = DEFAULT_TIMEOUT_S
    held: dict[str, _Held] = field(default_factory=dict)
    # Only a prefill engine keeps blocks (a KVSender turns this on): requests that ask
    # anywhere else are refused at intake, so no client can pin blocks.
    holding: bool = False
    num_imported_blocks: int = 0
    num_failed_imports: int = 0
    num_expired: int = 0
    # Blocks a copy that could not be stopped may still write: never reused.
    num_quarantined_blocks: int = 0

    # ------------------------------------------------------------ prefill side
    def start_holding(self) -> None:
        self.holding = True

    def hold(self, request: Request) -> list[int]:
        """Before a finished request's blocks are freed: keep its computed full blocks
        (a reference each) and return their ids, in order."""
        kv = self.kv_cache
        blocks = kv.req_blocks.get(request.request_id, [])
        kept = []
        for i, block in enumerate(blocks[:request.num_computed_tokens // kv.block_size]):
            if block.pending or i >= len(request.block_hashes) or block.block_hash != request.block_hashes[i]:
                break                   # (a leading run of this request's own chain: the decode side's must be whole)
            kept.append(block)
        for block in kept:
            kv.pool.touch(block)
        if kept:
            self.held[request.request_id] = _Held(kept, time.monotonic() + self.timeout_s)
        return [b.block_id for b in kept]

    def release(self, request_id: str) -> bool:
        held = self.held.pop(request_id, None)
        if held is None:
            return False
        for block in reversed(held.blocks):
            self.kv_cache.pool.release(block)
        return True

    def expire(self, now: Optional[float] = None) -> int:
        """Release what no decode engine claimed in time. Cheap when nothing is held."""
        if not self.held:
            return 0
        now = time.monotonic() if now is None else now
        late = [rid for rid, h in self.held.items() if h.deadline <= now]
        for rid in late:
            self.release(rid)
        self.num_expired += len(late)
        return len(late)

    # ------------------------------------------------------------- decode side
    def reserve_import(self, token_ids: Sequence[int], cache_salt: Optional[bytes],
                       max_blocks: int, lora_id: Optional[int] = None, ready: Any = None) -> Optional[ImportTicket]:
        """Blocks for the prompt's first `max_blocks` full blocks that are not cached here
        (at most; at least one prompt token stays to compute). None: nothing to import,
        or the pool has no room (the request then computes its prompt here)."""
        kv = self.kv_cache
        bs = kv.block_size
        if not kv.enable_prefix_caching:
            return None
        max_blocks = min(max_blocks, (len(token_ids) - 1) // bs)
        tokens = [tuple(token_ids[i * bs:(i + 1) * bs]) for i in range(max_blocks)]
        hashes = list(hash_chain(cache_salt, tokens))
        parents = ([cache_salt] + hashes)[:len(hashes)]
        pinned = []
        while len(pinned) < max_blocks:
            i = len(pinned)
            block = kv.pool.lookup(hashes[i], parents[i], tokens[i])
            if block is None or block.pending:
                break
            kv.pool.touch(block)
            pinned.append(block)
        num_cached = len(pinned)
        wanted = max_blocks - num_cached
        if wanted <= 0 or wanted > kv.pool.num_free_blocks:
            self._release(pinned)
            return None
        blocks = [kv.pool.allocate() for _ in range(wanted)]
        return ImportTicket(num_cached, blocks, hashes[num_cached:], parents[num_cached:], tokens[num_cached:],
                            lora_id, pinned, ready)

    def _release(self, blocks: Sequence[KVBlock]) -> None:
        for block in reversed(blocks):     # (the chain's head goes to the free queue last)
            self.kv_cache.pool.release(block)

    def commit_import(self, ticket: ImportTicket) -> int:
        """The transport filled the ticket's blocks: they join the prefix cache as
        computed blocks (KV events say so) and go to the free queue, to be hit. Returns
        how many were registered (a block whose content another block cached meanwhile
        is not)."""
        kv = self.kv_cache
        stored = 0
        for i, (block, block_hash, parent, tokens) in enumerate(
                zip(ticket.blocks, ticket.hashes, ticket.parents, ticket.token_ids)):
            if kv.pool.register(block, block_hash, parent, tokens):
                stored += 1
                if kv.events is not None:       # (a prompt's first block has no parent in events)
                    kv.events.stored([block_hash], parent if ticket.num_cached + i else None, list(tokens),
                                     lora_id=ticket.lora_id)
        self._release(ticket.pinned + ticket.blocks)
        self.num_imported_blocks += stored
        return stored

    def abort_import(self, ticket: ImportTicket) -> None:
        self._release(ticket.pinned + ticket.blocks)
        self.num_failed_imports += 1

    def quarantine_import(self, ticket: ImportTicket) -> None:
        """A copy that could not be stopped may still write the ticket's blocks: they stay
        referenced (out of the pool) for good; the cached run is let go."""
        self._release(ticket.pinned)
        self.num_quarantined_blocks += len(ticket.blocks)
        self.num_failed_imports += 1

    def stats(self) -> dict:
        return {"kv_handoff_held_requests": len(self.held), "kv_handoff_imported_blocks": self.num_imported_blocks,
                "kv_handoff_failed_imports": self.num_failed_imports, "kv_handoff_expired": self.num_expired,
                "kv_handoff_quarantined_blocks": self.num_quarantined_blocks}
