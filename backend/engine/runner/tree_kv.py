"""After a tree verification (spec_decode/token_tree.py): the accepted path's K/V moved
from its nodes' places to the positions the path now holds, before anything reads them
(the drafter's catch-up, the next step, the prefix cache's hash of a filled block).

The rest of the tree's K/V stays where it is, past the request's computed tokens: the
scheduler counts those slots as not computed (its proposal rollback), the next step
overwrites them, and blocks that held only them go back to the pool. One gather and one
scatter per layer, indices in one upload, no host sync.
"""

from __future__ import annotations

import numpy as np
import torch

from backend.attention.metadata import KVCacheLayer
from backend.engine.runner.buffers import GrowingStagedBuffer
from backend.engine.spec_decode.token_tree import moves


class TreeKVCompactor:
    def __init__(self, device: torch.device) -> None:
        self._index = GrowingStagedBuffer(torch.int64, device)

    def slot_moves(self, scheduled, states, paths: dict[int, list[int]], block_size: int
                   ) -> tuple[list[int], list[int]]:
        """(source slots, destination slots) for the accepted paths `paths` (by index in
        `scheduled`) of the requests still running (`states`: their RequestStates)."""
        src, dst = [], []
        for i, path in paths.items():
            s = scheduled[i]
            if not path or not states[i].running:
                continue                    # (finished or preempted since: nothing to keep)
            root = s.num_computed_tokens + s.num_new_tokens - len(s.spec_token_ids) - 1
            a, b = moves(path, root)
            table = states[i].block_ids
            if not a or max(a) // block_size >= len(table):
                continue

            def slot(index: int) -> int:
                return table[index // block_size] * block_size + index % block_size
            src += [slot(x) for x in a]
            dst += [slot(x) for x in b]
        return src, dst

    def compact(self, layers: list[KVCacheLayer], src: list[int], dst: list[int]) -> None:
        if not src:
            return
        index = self._index.upload(np.asarray(src + dst, dtype=np.int64))
        n = len(src)
        for layer in layers:
            for cache in (layer.key, layer.value):
                if cache.element_size() == 1:
                    cache = cache.view(torch.uint8)     # (FP8 has no index_copy: its bytes are copied)
                flat = cache.view(-1, *cache.shape[2:])
                flat.index_copy_(0, index[n:], flat.index_select(0, index[:n]))
