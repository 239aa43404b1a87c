"""Moving an accepted tree path's K/V into place (backend/engine/runner/tree_kv.py): the
slots follow each request's block table, requests no longer running move nothing, and
FP8, INT8 and fp32 caches are copied exactly."""

from types import SimpleNamespace

import pytest
import torch

from backend.attention.metadata import KVCacheLayer
from backend.engine.runner.tree_kv import TreeKVCompactor

BLOCK = 4


def scheduled(rid, computed, new, spec):
    return SimpleNamespace(request_id=rid, num_computed_tokens=computed, num_new_tokens=new, spec_token_ids=[0] * spec)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn, torch.int8])
def test_the_path_moves_to_the_positions_it_holds(dtype):
    tables = {"a": [7, 2, 5], "b": [3, 0], "gone": [1, 4]}
    # a: root at index 5, nodes 0..5 at 6..11; the path (1, 3) moves 7 -> 6 and 9 -> 7.
    # b: root at 2, a path already in place (0, 2 -> its second node sits at 5).
    sched = [scheduled("a", 5, 7, 6), scheduled("b", 2, 5, 4), scheduled("gone", 0, 3, 2)]
    states = [SimpleNamespace(running=rid != "gone", block_ids=tables[rid]) for rid in tables]
    kv = TreeKVCompactor(torch.device("cpu"))
    src, dst = kv.slot_moves(sched, states, {0: [1, 3], 1: [0, 2], 2: [1]}, BLOCK)

    def slot(rid, index):
        return tables[rid][index // BLOCK] * BLOCK + index % BLOCK
    assert src == [slot("a", 7), slot("a", 9), slot("b", 5)] and dst == [slot("a", 6), slot("a", 7), slot("b", 4)]
    values = torch.randn(8, BLOCK, 2, 3).to(dtype) if dtype != torch.int8 else torch.randint(-9, 9, (8, BLOCK, 2, 3),
                                                                                            dtype=torch.int8)
    layer = KVCacheLayer(values.clone(), values.clone())
    kv.compact([layer], src, dst)
    want = values.view(torch.uint8).clone().view(-1, 2, 3) if dtype.itemsize == 1 else values.clone().view(-1, 2, 3)
    for s, d in zip(src, dst):
        want[d] = want[s]
    for cache in (layer.key, layer.value):
        got = cache.view(torch.uint8) if dtype.itemsize == 1 else cache
        assert torch.equal(got.view(-1, 2, 3), want)
