"""vLLM's KV event wire format (`vllm/distributed/kv_events.py`): msgpack, array-like
structs, the event type as a tag. A subscriber written for vLLM (its
examples/online_serving/kv_events_subscriber.py, Dynamo's ZMQ relay) decodes ours with
its own classes. Block hashes go as vLLM sends them by default: 64-bit ints (the last 8
bytes of our SHA-256), or the whole 32 bytes with `block_hashes_as_bytes` (vLLM's
ExternalBlockHash is either). Needs msgspec (imported by the publisher's thread only)."""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the KV cache events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Optional[Union[int, bytes]]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Union[int, bytes]]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


def int_hash(h: bytes) -> int:
    """vLLM's default form of a block hash on the wire (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES):
    the last 8 bytes, big-endian, unsigned. Dynamo's listener reads hashes as 64-bit ints."""
    return int.from_bytes(h[-8:], "big")


def encode_batch(encoder, ts: float, events: list[tuple], block_size: int, int_hashes: bool = True) -> bytes:
    """The collector's tuples (collector.py) as one encoded KVEventBatch."""
    conv = int_hash if int_hashes else (lambda h: h)
    out = []
    for e in events:
        if e[0] == "stored":
            _, hashes, parent, token_ids, medium, lora_id = e
            out.append(BlockStored(block_hashes=[conv(h) for h in hashes],
                                   parent_block_hash=conv(parent) if parent is not None else None,
                                   token_ids=token_ids, block_size=block_size, lora_id=lora_id, medium=medium))
        elif e[0] == "removed":
            out.append(BlockRemoved(block_hashes=[conv(h) for h in e[1]], medium=e[2]))
        else:
            out.append(AllBlocksCleared())
    return encoder.encode(KVEventBatch(ts=ts, events=out))
