"""backend/engine/scheduling/block_pool.py: reference counts, eviction order and the
prefix cache's hash -> block map."""

import pytest

from backend.engine.scheduling.block_pool import BlockPool, hash_block, hash_chain


class Events:
    def __init__(self):
        self.removed_hashes, self.clearing_calls = [], []

    def removed(self, block_hash):
        self.removed_hashes.append(block_hash)

    def clearing(self, on):
        self.clearing_calls.append(on)


def test_hashes_chain_on_the_parent_and_the_tokens():
    a, b = hash_block(None, [1, 2]), hash_block(None, [1, 3])
    assert a != b and hash_block(a, [1, 2]) != a
    assert list(hash_chain(None, [[1, 2], [3, 4]])) == [a, hash_block(a, [3, 4])]


def test_a_released_block_without_a_hash_is_reused_before_cached_ones():
    pool = BlockPool(3)
    cached, plain = pool.allocate(), pool.allocate()
    h = hash_block(None, (5, 6))
    assert pool.register(cached, h, None, (5, 6))
    pool.release(cached)                     # kept for a prefix hit: the back of the queue
    pool.release(plain)                      # nothing to keep: the front
    assert pool.allocate() is plain
    assert pool.allocate().block_id == 2     # the never-used one, before the cached block
    assert pool.lookup(h, None, (5, 6)) is cached
    assert pool.allocate() is cached and pool.lookup(h, None, (5, 6)) is None   # evicted on reuse


def test_a_hit_takes_the_block_off_the_free_queue_and_a_double_release_is_caught():
    pool = BlockPool(2)
    block = pool.allocate()
    pool.register(block, hash_block(None, (1,)), None, (1,))
    pool.release(block)
    assert pool.num_free_blocks == 2
    pool.touch(block)
    assert pool.num_free_blocks == 1 and block.ref_cnt == 1
    pool.release(block)
    with pytest.raises(AssertionError, match="released twice"):
        pool.release(block)


def test_lookup_checks_the_tokens_and_the_parent_not_only_the_hash():
    pool = BlockPool(1)
    block = pool.allocate()
    h = hash_block(None, (1, 2))
    pool.register(block, h, None, (1, 2))
    assert pool.lookup(h, None, (1, 2)) is block
    assert pool.lookup(h, None, (1, 9)) is None and pool.lookup(h, b"other", (1, 2)) is None


def test_the_first_copy_of_a_content_is_kept():
    pool = BlockPool(2)
    first, second = pool.allocate(), pool.allocate()
    h = hash_block(None, (3,))
    assert pool.register(first, h, None, (3,)) and not pool.register(second, h, None, (3,))
    assert pool.lookup(h, None, (3,)) is first and second.block_hash is None


def test_a_pending_block_released_before_its_step_ran_is_no_hit():
    """Registered when scheduled, its K/V written by a step that never ran (aborted)."""
    events = Events()
    pool = BlockPool(1, events)
    block = pool.allocate()
    h = hash_block(None, (4,))
    pool.register(block, h, None, (4,), pending=True)
    pool.release(block)
    assert pool.lookup(h, None, (4,)) is None and not block.pending and events.removed_hashes == [h]


def test_reset_evicts_every_cached_block_under_one_clearing_event():
    events = Events()
    pool = BlockPool(3, events)
    blocks = [pool.allocate() for _ in range(3)]
    hashes = [hash_block(None, (i,)) for i in range(3)]
    for block, h, i in zip(blocks, hashes, range(3)):
        pool.register(block, h, None, (i,))
        pool.release(block)
    pool.reset_prefix_cache()
    assert pool.cached == {} and sorted(events.removed_hashes) == sorted(hashes)
    assert events.clearing_calls == [True, False] and pool.num_free_blocks == 3
