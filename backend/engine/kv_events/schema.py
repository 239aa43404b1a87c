"""vLLM's KV event wire format (`vllm/distributed/kv_events.py`): msgpack, array-like
structs, the event type as a tag. A subscriber written for vLLM (its
examples/online_serving/kv_events_subscriber.py, Dynamo's ZMQ relay) decodes ours with
its own classes. Block hashes are bytes (vLLM's ExternalBlockHash is bytes or int).
Needs msgspec (imported by the publisher's thread only)."""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the KV cache events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: Optional[bytes]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


def encode_batch(encoder, ts: float, events: list[tuple], block_size: int) -> bytes:
    """The collector's tuples (collector.py) as one encoded KVEventBatch."""
    out = []
    for e in events:
        if e[0] == "stored":
            out.append(BlockStored(block_hashes=e[1], parent_block_hash=e[2], token_ids=e[3], block_size=block_size,
                                   lora_id=None, medium=e[4]))
        elif e[0] == "removed":
            out.append(BlockRemoved(block_hashes=e[1], medium=e[2]))
        else:
            out.append(AllBlocksCleared())
    return encoder.encode(KVEventBatch(ts=ts, events=out))
