"""The host-memory KV tier's runner side: a pool of host slots shaped like the device's
blocks (every layer's K and V), and the copies a step's KVTransfers name.

On CUDA the host pool is pinned. Saves (device to host) run on a side stream that first
waits for the work issued so far: the forward that wrote the blocks, and earlier loads
that read the slots. The step's forward waits for them only when it writes a block being
saved (`wait_for_saves`). Loads (host to device) run on the step's stream before its
forward, after the latest saves, since a load may read a slot saved just before it.
Nothing here waits on the host. On CPU the copies run in place, in order.
"""

from __future__ import annotations

from typing import Optional

import torch

from backend.engine.kv_offload.connector import KVConnectorWorker, KVTransfers


class HostKVCache(KVConnectorWorker):
    def __init__(self, kv_caches: list, num_slots: int) -> None:
        self.layers = kv_caches
        self.device = kv_caches[0].key.device
        self.cuda = self.device.type == "cuda"
        shape = (num_slots, *kv_caches[0].key.shape[1:])
        self.host = [(torch.zeros(shape, dtype=layer.key.dtype, pin_memory=self.cuda),
                      torch.zeros(shape, dtype=layer.value.dtype, pin_memory=self.cuda)) for layer in kv_caches]
        self._side = torch.cuda.Stream(self.device) if self.cuda else None
        self._saved: Optional[torch.cuda.Event] = None
        self.num_loaded_blocks = 0
        self.num_saved_blocks = 0

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.host)

    def start_transfers(self, transfers: KVTransfers) -> None:
        if transfers.saves:
            self._save(transfers.saves, transfers.wait_for_saves)
        if transfers.loads:
            self._load(transfers.loads)

    def _save(self, pairs: list[tuple[int, int]], wait: bool) -> None:
        self.num_saved_blocks += len(pairs)
        if not self.cuda:
            blocks, slots = (torch.tensor(x, dtype=torch.long) for x in zip(*pairs))
            for (host_k, host_v), layer in zip(self.host, self.layers):
                host_k.index_copy_(0, slots, layer.key.index_select(0, blocks))
                host_v.index_copy_(0, slots, layer.value.index_select(0, blocks))
            return
        main = torch.cuda.current_stream(self.device)
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            for (host_k, host_v), layer in zip(self.host, self.layers):
                for block, slot in pairs:
                    host_k[slot].copy_(layer.key[block], non_blocking=True)
                    host_v[slot].copy_(layer.value[block], non_blocking=True)
            self._saved = torch.cuda.Event()
            self._saved.record(self._side)
        if wait:
            main.wait_event(self._saved)

    def _load(self, pairs: list[tuple[int, int]]) -> None:
        self.num_loaded_blocks += len(pairs)
        if not self.cuda:
            slots, blocks = (torch.tensor(x, dtype=torch.long) for x in zip(*pairs))
            for (host_k, host_v), layer in zip(self.host, self.layers):
                layer.key.index_copy_(0, blocks, host_k.index_select(0, slots))
                layer.value.index_copy_(0, blocks, host_v.index_select(0, slots))
            return
        if self._saved is not None:
            torch.cuda.current_stream(self.device).wait_event(self._saved)
        for (host_k, host_v), layer in zip(self.host, self.layers):
            for slot, block in pairs:
                layer.key[block].copy_(host_k[slot], non_blocking=True)
                layer.value[block].copy_(host_v[slot], non_blocking=True)
