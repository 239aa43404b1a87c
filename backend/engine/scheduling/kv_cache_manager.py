"""Paged KV-cache bookkeeping: a pool of fixed-size blocks, per-request block tables and
prefix caching.

Prefix caching follows vLLM v1's design: a full block is identified by a hash chained
over its parent's hash and its own token ids, so a block can be shared only when the
whole prefix before it matches. A hit is also checked token for token. Blocks whose
reference count drops to zero go back to the free queue but keep their contents and
hash, so a later request can revive them; allocation takes the least recently freed
block and evicts its hash. Every operation is O(1) per block.

Full blocks are registered when a step that fills them is scheduled (vLLM v1 caches
them in `allocate_slots`), not after it ran: a block whose tokens are all known is
in the cache from then on, *pending* until the step has written its K/V. A request that
would hit a pending block is not admitted in that step (`find_cached_blocks` returns
None): it waits one step and then shares the computed block. So `n` > 1 children, or
concurrent requests with one prompt, admitted together compute the prompt once. A
pending block released before its step ran (its request preempted in the same
schedule) leaves the cache at once.

Sliding windows (`sliding_window`, set when every layer has one): once a request's
computed tokens are far enough along, its leading blocks that fall wholly before the
window of every future query go back to the pool (`free_outside_window`, called by the
scheduler before it allocates a running request's slots), so a long generation holds
about window / block_size + 1 blocks. Their ids stay in the block table (the attention
backends mask those positions, and the Triton kernels do not read them); with prefix
caching only computed blocks are freed, and they stay cached for later hits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from backend.engine.block_table import BlockTable
from backend.engine.kv_offload.connector import ExternalHit, KVConnectorScheduler, KVTransfers
from backend.engine.request import Request
from backend.engine.scheduling.block_pool import BlockPool, KVBlock, hash_chain

if TYPE_CHECKING:
    from backend.engine.scheduling.sched_output import SchedulerOutput

_EMPTY = BlockTable()


def num_device_hits(cached: Sequence) -> int:
    """How many of find_cached_blocks' hits are the pool's own blocks (the connector's,
    after them, still need a block each)."""
    return sum(1 for b in cached if not isinstance(b, ExternalHit))


class KVCacheManager:
    """Maps requests to blocks: block tables and prefix-cache hits (slot mapping is
    the step builder's, backend/engine/runner/step_inputs.py)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 sliding_window: Optional[int] = None, connector: Optional[KVConnectorScheduler] = None,
                 events=None) -> None:
        """connector: a store of blocks beyond the pool (backend/engine/kv_offload/): it
        keeps every computed full block, and a request's prefix continues there after
        the pool's hits. events: a KVEventCollector (backend/engine/kv_events/) told of
        every block cached and evicted."""
        self.block_size = block_size
        self.connector = connector
        self.sliding_window = sliding_window
        # Leading blocks of each request given back by free_outside_window.
        self._num_released: dict[str, int] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, events)
        self.events = events
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # The same tables as block ids, kept in step with req_blocks: each step hands the
        # runner what changed in its requests' tables (set_block_diffs).
        self.req_block_ids: dict[str, BlockTable] = {}
        # How many leading blocks of each request are registered in the prefix cache, and
        # how many of those hold computed K/V (the rest are pending).
        self._num_registered: dict[str, int] = {}
        self._num_computed_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hit_tokens = 0
        # Requests whose tables changed since the last set_block_diffs.
        self._changed: set[str] = set()

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids (read-only: the manager's own BlockTable, the same
        object for as long as the request holds blocks)."""
        return self.req_block_ids.get(request_id, _EMPTY)

    def set_block_diffs(self, out: "SchedulerOutput") -> None:
        """What changed in block tables since the last step, for the runner's copies
        (block_table.py): each scheduled request's `block_ids_start` and `new_block_ids`,
        and in `out.other_block_diffs` those of requests not in the step whose tables
        changed meanwhile (proposal-only blocks taken back while their step is in
        flight: its draft must not write past them). A table made again after the
        request gave its blocks back (preempted) starts from entry 0. Called once the
        step's allocations are all made."""
        if not self._changed:
            return                      # (a ScheduledRequest's diff is None by default)
        scheduled = {s.request_id: s for s in out.scheduled}
        for request_id in self._changed:
            table = self.req_block_ids.get(request_id)
            if table is None:
                continue                # (freed since: the runner hears of it by id)
            start, ids = table.take_diff()
            if ids is None:
                continue
            s = scheduled.get(request_id)
            if s is not None:
                s.block_ids_start, s.new_block_ids = start, ids
            else:
                out.other_block_diffs[request_id] = (start, ids)
        self._changed.clear()

    # ------------------------------------------------------------ prefix cache
    def _update_block_hashes(self, request: Request) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        if len(hashes) >= request.num_tokens // bs:
            return                      # no newly full block
        hashes.extend(hash_chain(hashes[-1] if hashes else request.cache_salt,
                                 (request.block_key(i, bs) for i in range(len(hashes), request.num_tokens // bs))))

    def find_cached_blocks(self, request: Request, max_tokens: Optional[int] = None,
                           peek: bool = False) -> Optional[list[KVBlock]]:
        """Longest run of cached full blocks matching the request's leading tokens, or None
        when that run reaches a pending block (admit the request after the step that
        computes it, and it shares the block).

        At least one token is always left to compute, since the step must produce the
        logits of the last one; max_tokens: at most that many tokens come from the cache
        (a request that needs the logits of the positions after them). peek: a look
        that counts no query in the prefix-cache metrics (the scheduler's look ahead
        at requests it may admit later in the step).
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        if max_tokens is not None and max_tokens < bs:
            return []                   # not even a block: no query (and nothing counted)
        self._update_block_hashes(request)
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // bs
        if max_tokens is not None:
            max_blocks = min(max_blocks, max_tokens // bs)
        found: list = []
        for i in range(max_blocks):
            parent = request.block_hashes[i - 1] if i else request.cache_salt
            block = self.pool.lookup(request.block_hashes[i], parent, request.block_key(i, bs))
            if block is None:
                break
            if block.pending:
                return None
            found.append(block)
        if not peek:
            self.prefix_cache_queries += len(tokens)
            self.prefix_cache_hit_tokens += len(found) * bs
        if self.connector is not None and len(found) < max_blocks:
            found += self.connector.lookup(request, len(found), max_blocks)     # (ExternalHits, after the pool's)
        return found

    # --------------------------------------------------------------- allocation
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: Sequence[KVBlock] = ()) -> bool:
        """Reserve blocks for `num_new_tokens` more tokens after the computed ones.

        `cached_blocks` are prefix-cache hits to attach first (only on admission), then
        the connector's hits (ExternalHit), which get new blocks loaded in this step.
        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        blocks = self.req_blocks.setdefault(request.request_id, [])
        bs = self.block_size
        num_computed = request.num_computed_tokens + len(cached_blocks) * bs
        num_required = -(-(num_computed + num_new_tokens) // bs)
        external: Sequence[ExternalHit] = ()
        if cached_blocks and isinstance(cached_blocks[-1], ExternalHit):
            num_device = next(i for i, b in enumerate(cached_blocks) if isinstance(b, ExternalHit))
            cached_blocks, external = cached_blocks[:num_device], cached_blocks[num_device:]
        num_new_blocks = num_required - len(blocks) - len(cached_blocks)
        if num_new_blocks <= 0 and not cached_blocks and not external:
            if self.enable_prefix_caching:      # (a chunk or a decode may complete a block)
                self._register(request, blocks, min(num_computed + num_new_tokens, request.num_tokens) // bs,
                               pending=True)
            return True                 # most decode steps: the last block has room
        # Cached hits that sit in the free queue are taken out of it by touching them.
        num_evictable_hits = sum(1 for b in cached_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_evictable_hits:
            if not blocks:
                del self.req_blocks[request.request_id]
            return False
        for block in cached_blocks:
            self.pool.touch(block)
        blocks.extend(cached_blocks)
        new = [self.pool.allocate() for _ in range(max(num_new_blocks, 0))]
        blocks.extend(new)
        if self.connector is not None:
            for block in new:
                self.connector.on_reused(block)
            if external:
                self.connector.on_allocated(external, new[:len(external)])
        ids = self.req_block_ids.setdefault(request.request_id, BlockTable())
        ids.append_blocks([b.block_id for b in blocks[len(ids):]])
        self._changed.add(request.request_id)
        if cached_blocks or external:
            # Hits are already in the prefix cache; registration resumes after them.
            self._num_registered[request.request_id] = len(cached_blocks)
            self._num_computed_blocks[request.request_id] = len(cached_blocks)
        if self.enable_prefix_caching:
            # Blocks this step fills with known tokens (not proposals): cached now, pending.
            self._register(request, blocks, min(num_computed + num_new_tokens, request.num_tokens) // bs,
                           pending=True)
        return True

    def _register(self, request: Request, blocks: list[KVBlock], num_full: int, pending: bool) -> None:
        """Register the request's blocks up to `num_full` that are not registered yet."""
        rid = request.request_id
        start = self._num_registered.get(rid, 0)
        num_full = min(num_full, len(blocks))
        if num_full <= start:
            return                      # most steps fill no block
        self._update_block_hashes(request)
        bs = self.block_size
        stored: list[int] = []              # (KV events: the blocks cached by this call)
        for i in range(start, num_full):      # the new full blocks' tokens only
            parent = request.block_hashes[i - 1] if i else request.cache_salt
            if self.pool.register(blocks[i], request.block_hashes[i], parent,
                                  request.block_key(i, bs), pending) and self.events:
                stored.append(i)
        self._num_registered[rid] = num_full
        if stored:
            self._stored_events(request, stored)

    def _stored_events(self, request: Request, indices: list[int]) -> None:
        """One BlockStored per run of consecutive blocks; the parent of a run that starts
        the prompt is None (the chain's root, an adapter's salt, is in every hash)."""
        bs, hashes = self.block_size, request.block_hashes
        runs = [[indices[0]]]
        for i in indices[1:]:
            if i == runs[-1][-1] + 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        lora_id = self.events.lora_id(request)
        for run in runs:
            first, end = run[0], run[-1] + 1
            self.events.stored(hashes[first:end], hashes[first - 1] if first else None,
                               request.token_slice(first * bs, end * bs), lora_id=lora_id)

    def cache_computed_blocks(self, request: Request) -> None:
        """After a step: the request's full blocks of computed tokens are hits from now on
        (pending ones become computed; blocks filled by accepted proposals, which were not
        tokens when the step was scheduled, are registered)."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return
        rid = request.request_id
        # Only blocks of final tokens: accepted proposals join the request's tokens only
        # after this is first called for their step (the engine calls it again then).
        num_full = min(min(request.num_computed_tokens, request.num_tokens) // self.block_size, len(blocks))
        done = self._num_computed_blocks.get(rid, 0)
        if num_full <= done:
            return                      # most decode steps fill no block
        self._register(request, blocks, num_full, pending=False)
        for i in range(done, num_full):
            blocks[i].pending = False
        self._num_computed_blocks[rid] = num_full
        if self.connector is not None:
            self.connector.on_computed(blocks[done:num_full], first_index=done)

    def take_transfers(self) -> Optional[KVTransfers]:
        """The connector's copies for the step being scheduled (None: none)."""
        return self.connector.take_transfers() if self.connector is not None else None

    def num_blocks_beyond(self, request: Request, num_tokens: int) -> int:
        """How many of the request's blocks lie past those its first `num_tokens` need."""
        return max(0, len(self.req_blocks.get(request.request_id, ())) - -(-num_tokens // self.block_size))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks past those that hold the request's first `num_tokens`
        (rejected proposals'). They were never registered: only full blocks of computed
        tokens are."""
        blocks = self.req_blocks.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if not blocks or len(blocks) <= keep:
            return
        for block in reversed(blocks[keep:]):
            self.pool.release(block)
        del blocks[keep:]
        self.req_block_ids[request.request_id].truncate(keep)
        self._changed.add(request.request_id)

    def free(self, request: Request) -> None:
        """Give back every block of the request. Tail blocks are queued first, so
        they are evicted before the shared prefix blocks."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_block_ids.pop(request.request_id, None)
        self._changed.discard(request.request_id)      # (the runner hears of it by id)
        self._num_registered.pop(request.request_id, None)
        self._num_computed_blocks.pop(request.request_id, None)
        released = self._num_released.pop(request.request_id, 0)
        for block in reversed(blocks[released:]):
            self.pool.release(block)

    def free_outside_window(self, request: Request) -> int:
        """Give back the request's leading blocks that no query from its next computed
        token on can see: a query at position p reads keys p - window + 1 .. p, so block
        i is done once (i + 1) * block_size <= num_computed_tokens - window + 1. Blocks a
        step still in flight reads may go: any reuse is written by a later step, which
        runs after it. With prefix caching only computed (no longer pending) blocks go,
        so the bookkeeping after the step never touches a block given back. Returns how
        many blocks went back."""
        if self.sliding_window is None:
            return 0
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if not blocks:
            return 0
        done = min(len(blocks), (request.num_computed_tokens - self.sliding_window + 1) // self.block_size)
        if self.enable_prefix_caching:
            done = min(done, self._num_computed_blocks.get(rid, 0))
        start = self._num_released.get(rid, 0)
        if done <= start:
            return 0
        for block in blocks[start:done]:
            self.pool.release(block)
        self._num_released[rid] = done
        return done - start

    def reset_prefix_cache(self) -> None:
        """Every cached block goes, the connector's (the host tier's) too: one
        AllBlocksCleared in KV events."""
        self.pool.reset_prefix_cache()
        if self.connector is not None:
            self.connector.reset()
