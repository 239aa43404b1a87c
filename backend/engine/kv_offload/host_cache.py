"""The host-memory KV tier's runner side: a pool of host slots shaped like the device's
blocks (every layer's K and V), and the copies a step's KVTransfers name.

On CUDA the host pool is one buffer of exactly its size, page-locked with
cudaHostRegister (torch's pinned allocator would round it up to a power of two and keep
it cached after the engine goes). Saves (device to host) run on a side stream that first
waits for the work issued so far: the forward that wrote the blocks, and earlier loads
that read the slots. They overlap the forward of the step that issued them. That
forward waits for them only when it writes a block being saved (`wait_for_saves`). The
next step's forward always waits for them, since its allocations may reuse a saved
block. Loads (host to device) run on the step's stream before its forward, after the
latest saves, since a load may read a slot saved just before it. Nothing here waits on
the host. On CPU the copies run in place, in order.
"""

from __future__ import annotations

import logging
import weakref
from typing import Optional

import torch

from backend.engine.kv_offload.connector import KVConnectorWorker, KVTransfers


logger = logging.getLogger(__name__)


def _host_buffer(nbytes: int, cuda: bool) -> torch.Tensor:
    """nbytes of host memory; on CUDA page-locked in place (copies from it are async),
    unlocked when the tensor goes."""
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    if not cuda:
        return buffer
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)
    if int(getattr(err, "value", err)) != 0:
        logger.warning("cudaHostRegister of the host KV tier failed (%s): using torch's pinned allocator", err)
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())
    return buffer


class HostKVCache(KVConnectorWorker):
    def __init__(self, kv_caches: list, num_slots: int) -> None:
        self.layers = kv_caches
        self.device = kv_caches[0].key.device
        self.cuda = self.device.type == "cuda"
        shape = (num_slots, *kv_caches[0].key.shape[1:])
        block = kv_caches[0].key[0]
        per_tensor = num_slots * block.numel() * block.element_size()
        self._buffer = _host_buffer(2 * len(kv_caches) * per_tensor, self.cuda)
        views = [self._buffer[i * per_tensor:(i + 1) * per_tensor].view(kv_caches[0].key.dtype).view(shape)
                 for i in range(2 * len(kv_caches))]
        self.host = [(views[2 * i], views[2 * i + 1]) for i in range(len(kv_caches))]
        self._side = torch.cuda.Stream(self.device) if self.cuda else None
        self._saved: Optional[torch.cuda.Event] = None
        self.num_loaded_blocks = 0
        self.num_saved_blocks = 0

    def start_transfers(self, transfers: Optional[KVTransfers]) -> None:
        """Before every forward (`transfers` None when the step has none)."""
        if self._saved is not None:         # the last step's saves, before anything may reuse their blocks
            torch.cuda.current_stream(self.device).wait_event(self._saved)
            self._saved = None
        if transfers is None:
            return
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
        if self._saved is not None:         # this step's saves: a load may read a slot just saved
            torch.cuda.current_stream(self.device).wait_event(self._saved)
        for (host_k, host_v), layer in zip(self.host, self.layers):
            for slot, block in pairs:
                layer.key[block].copy_(host_k[slot], non_blocking=True)
                layer.value[block].copy_(host_v[slot], non_blocking=True)
