"""Block pool and KV-cache manager: reference counts, free pool, prefix hits, eviction."""

from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from backend.engine.scheduling.block_pool import BlockPool
from backend.engine.scheduling.kv_cache_manager import KVCacheManager
from backend.engine.request import Request
from backend.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=SamplingParams(),
                   arrival_time=0.0, max_tokens=16)


def admit(kv: KVCacheManager, req: Request) -> bool:
    cached = kv.find_cached_blocks(req)
    ok = kv.allocate_slots(req, req.num_tokens - len(cached) * BS, cached)
    if ok:
        req.num_computed_tokens = req.num_tokens
        kv.cache_computed_blocks(req)
    return ok


def test_block_table():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    req = make_request("a", list(range(10)))
    assert kv.allocate_slots(req, 10)
    table = kv.block_table("a")
    assert len(table) == 3
    assert [b.block_id for b in kv.req_blocks["a"]] == table
    assert kv.num_free_blocks == 5


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(2, BS, enable_prefix_caching=False)
    req = make_request("a", list(range(12)))
    assert not kv.allocate_slots(req, 12)
    assert kv.num_free_blocks == 2 and kv.block_table("a") == []


def test_prefix_hit_shares_blocks_and_checks_tokens():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = make_request("a", list(range(10)))
    assert admit(kv, a)
    b = make_request("b", list(range(8)) + [99, 98, 97])
    hits = kv.find_cached_blocks(b)
    assert [h.block_id for h in hits] == kv.block_table("a")[:2]
    assert admit(kv, b)
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert all(blk.ref_cnt == 2 for blk in kv.req_blocks["b"][:2])
    # Same hash input but different parent: no hit past the first differing block.
    c = make_request("c", [0, 1, 2, 77] + list(range(4, 8)) + [1])
    assert kv.find_cached_blocks(c) == []


def test_a_peek_finds_the_same_hits_and_counts_no_query():
    """(The priority scheduler looks ahead at requests it may admit later in the step:
    the prefix-cache metrics count each request's admission only.)"""
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    assert admit(kv, make_request("a", list(range(10))))
    b = make_request("b", list(range(8)) + [99, 98, 97])
    counted = (kv.prefix_cache_queries, kv.prefix_cache_hit_tokens)
    assert kv.find_cached_blocks(b, peek=True) == kv.find_cached_blocks(b)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hit_tokens) == (counted[0] + b.num_tokens, counted[1] + 2 * BS)


def test_freed_cached_blocks_are_revived_then_evicted_lru():
    kv = KVCacheManager(6, BS, enable_prefix_caching=True)
    a = make_request("a", list(range(9)))
    assert admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 6 and len(kv.pool.cached) == 2
    again = make_request("a2", list(range(9)))
    assert len(kv.find_cached_blocks(again)) == 2
    # A big request takes every block: cached ones are evicted, hashes dropped.
    big = make_request("big", [50 + i for i in range(24)])
    assert admit(kv, big)
    assert kv.num_free_blocks == 0
    kv.free(big)
    assert kv.find_cached_blocks(make_request("a3", list(range(9)))) == []


def test_free_queue_prefers_uncached_blocks():
    pool = BlockPool(3)
    blocks = [pool.allocate() for _ in range(3)]
    pool.register(blocks[0], b"h0", None, (1, 2))
    for b in blocks:
        pool.release(b)
    # The cached block is last in line for reuse.
    assert pool.allocate() is not blocks[0]
    assert pool.allocate() is not blocks[0]


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / share / grow / free / evict sequences keep the books straight."""

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(12, BS, enable_prefix_caching=True)
        self.live: dict[str, Request] = {}
        self.n = 0

    @rule(prefix=st.sampled_from([[1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9]]),
          tail=st.lists(st.integers(0, 5), max_size=9))
    def add(self, prefix, tail):
        self.n += 1
        req = make_request(f"r{self.n}", prefix + tail)
        if admit(self.kv, req):
            self.live[req.request_id] = req

    @precondition(lambda self: self.live)
    @rule(data=st.data(), k=st.integers(1, 6))
    def grow(self, data, k):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live[rid]
        if self.kv.allocate_slots(req, k):
            req.prompt_token_ids.extend([7] * k)
            req.num_computed_tokens += k
            self.kv.cache_computed_blocks(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.kv.free(self.live.pop(rid))

    @invariant()
    def books_balance(self):
        pool = self.kv.pool
        refs = {}
        for rid, blocks in self.kv.req_blocks.items():
            for b in blocks[self.kv._num_released.get(rid, 0):]:     # (given back out of the window)
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0)
            assert (b.ref_cnt == 0) == (b.block_id in pool.free_queue)
        for h, b in pool.cached.items():
            assert b.block_hash == h
        # The id lists the model runner reads are the block tables.
        assert set(self.kv.req_block_ids) <= set(self.kv.req_blocks)
        for rid, blocks in self.kv.req_blocks.items():
            assert self.kv.block_table(rid) == [b.block_id for b in blocks]
        # Every live request owns enough slots for its tokens.
        for rid, req in self.live.items():
            assert len(self.kv.req_blocks[rid]) * BS >= req.num_tokens

    def teardown(self):
        for req in list(self.live.values()):
            self.kv.free(req)
        assert self.kv.num_free_blocks == 12


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class WindowedBlockManagerMachine(BlockManagerMachine):
    """The same with a 6-token window: blocks out of it go back mid-sequence (still
    cached, so later requests hit them), and each request keeps what its window needs."""

    WINDOW = 6

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(12, BS, enable_prefix_caching=True, sliding_window=self.WINDOW)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def slide(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live[rid]
        before = self.kv._num_released.get(rid, 0)
        freed = self.kv.free_outside_window(req)
        # Every computed block wholly before the next query's window, no other.
        done = min(len(self.kv.req_blocks[rid]), (req.num_computed_tokens - self.WINDOW + 1) // BS,
                   self.kv._num_computed_blocks.get(rid, 0))
        assert self.kv._num_released.get(rid, 0) == max(before, done) == before + freed

    @invariant()
    def window_blocks_kept(self):
        for rid, req in self.live.items():
            released = self.kv._num_released.get(rid, 0)
            # The next query (position num_computed_tokens) reads from num_computed - W + 1.
            assert released * BS <= max(0, req.num_computed_tokens - self.WINDOW + 1)


TestWindowedBlockManagerMachine = WindowedBlockManagerMachine.TestCase
TestWindowedBlockManagerMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def test_window_gives_back_leading_blocks_once():
    kv = KVCacheManager(16, BS, enable_prefix_caching=False, sliding_window=6)
    req = make_request("a", list(range(3, 23)))      # 20 tokens: 5 blocks
    assert admit(kv, req)
    # The next query is at 20, reading 15..20: blocks 0-2 (tokens 0-11) are done.
    assert kv.free_outside_window(req) == 3 and kv.num_free_blocks == 16 - 2
    assert kv.free_outside_window(req) == 0
    assert kv.block_table("a") == [b.block_id for b in kv.req_blocks["a"]]   # ids kept in place
    kv.free(req)
    assert kv.num_free_blocks == 16


def test_blocks_are_cached_when_scheduled_pending_until_computed():
    """Full blocks are registered when allocated for a step, pending: a request that
    would hit one is told to wait (None), and after the step it shares them."""
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = make_request("a", list(range(10)))
    assert kv.find_cached_blocks(a) == []
    assert kv.allocate_slots(a, 10)
    assert len(kv.pool.cached) == 2 and all(b.pending for b in kv.req_blocks["a"][:2])
    b = make_request("b", list(range(9)))
    queries = kv.prefix_cache_queries
    assert kv.find_cached_blocks(b) is None and kv.prefix_cache_queries == queries   # not counted
    # A request whose first block differs is not held back.
    assert kv.find_cached_blocks(make_request("c", [5] * 9)) == []
    a.num_computed_tokens = 10                  # the step ran
    kv.cache_computed_blocks(a)
    assert not any(blk.pending for blk in kv.req_blocks["a"])
    hits = kv.find_cached_blocks(b)
    assert [h.block_id for h in hits] == kv.block_table("a")[:2]
    kv.free(a)
    assert kv.num_free_blocks == 16


def test_a_pending_block_freed_before_its_step_leaves_the_cache():
    """A request preempted in the schedule that allocated its blocks: the blocks were
    never written, so they must not be found."""
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a = make_request("a", list(range(9)))
    assert kv.allocate_slots(a, 9)
    assert len(kv.pool.cached) == 2
    kv.free(a)
    assert kv.pool.cached == {} and not any(b.pending or b.block_hash for b in kv.pool.blocks)
    assert kv.find_cached_blocks(make_request("b", list(range(9)))) == []


def test_chunks_register_the_blocks_they_complete():
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a = make_request("a", list(range(12)))
    assert kv.allocate_slots(a, 6)              # block 0 full, block 1 half
    assert [b.block_hash is not None for b in kv.req_blocks["a"]] == [True, False]
    a.num_computed_tokens = 6
    kv.cache_computed_blocks(a)
    assert kv.allocate_slots(a, 2)              # completes block 1 without a new block
    assert kv.req_blocks["a"][1].pending
    a.num_computed_tokens = 8
    kv.cache_computed_blocks(a)
    assert not kv.req_blocks["a"][1].pending
    kv.free(a)


def test_adapters_salt_the_chain_and_do_not_wait_on_each_other():
    from backend.lora import cache_salt
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = make_request("a", list(range(9)))
    a.cache_salt = cache_salt("sql")
    assert kv.allocate_slots(a, 9)
    base = make_request("b", list(range(9)))
    assert kv.find_cached_blocks(base) == []    # another chain: neither a hit nor a wait
    a.num_computed_tokens = 9
    kv.cache_computed_blocks(a)
    assert kv.find_cached_blocks(base) == []
    kv.free(a)
