"""backend/engine/kv_events/schema.py: the collector's tuples encoded as vLLM's
KVEventBatch, decoded here with msgspec against the schema's own classes: each event's
type tag and fields in vLLM's order, hashes as vLLM's default 64-bit ints (the last 8
bytes, big-endian) or whole bytes."""

import pytest

msgspec = pytest.importorskip("msgspec")

from backend.engine.kv_events import schema  # noqa: E402

H1, H2, PARENT = bytes(range(32)), bytes(range(32, 64)), bytes(range(64, 96))
EVENTS = [("stored", [H1, H2], PARENT, [5, 6, 7, 8], "GPU", 12), ("stored", [H1], None, [1], "CPU", None),
          ("removed", [H2], "CPU"), ("cleared",)]


def decode(data: bytes) -> schema.KVEventBatch:
    return msgspec.msgpack.Decoder(schema.KVEventBatch).decode(data)


def test_int_hash_is_the_last_eight_bytes_big_endian():
    assert schema.int_hash(H1) == int.from_bytes(bytes(range(24, 32)), "big")
    assert schema.int_hash(b"\x00" * 24 + b"\xff" * 8) == 2 ** 64 - 1


def test_events_encode_as_vllms_batch_with_int_hashes():
    batch = decode(schema.encode_batch(msgspec.msgpack.Encoder(), 12.5, EVENTS, block_size=4))
    assert batch.ts == 12.5 and batch.data_parallel_rank is None
    stored, stored_cpu, removed, cleared = batch.events
    assert stored == schema.BlockStored(block_hashes=[schema.int_hash(H1), schema.int_hash(H2)],
                                        parent_block_hash=schema.int_hash(PARENT), token_ids=[5, 6, 7, 8],
                                        block_size=4, lora_id=12, medium="GPU")
    assert stored_cpu.parent_block_hash is None and stored_cpu.lora_id is None and stored_cpu.medium == "CPU"
    assert removed == schema.BlockRemoved(block_hashes=[schema.int_hash(H2)], medium="CPU")
    assert isinstance(cleared, schema.AllBlocksCleared)


def test_whole_hashes_with_block_hashes_as_bytes():
    batch = decode(schema.encode_batch(msgspec.msgpack.Encoder(), 0.0, EVENTS[:1], block_size=4, int_hashes=False))
    assert batch.events[0].block_hashes == [H1, H2] and batch.events[0].parent_block_hash == PARENT


def test_the_wire_is_array_like_with_the_tag_first():
    """vLLM's structs are array_like with the class name as tag: a plain msgpack reader
    sees [ts, [[tag, field, ...], ...]] in declaration order."""
    raw = msgspec.msgpack.decode(schema.encode_batch(msgspec.msgpack.Encoder(), 1.0, EVENTS[2:], block_size=4))
    assert raw[0] == 1.0
    assert raw[1] == [["BlockRemoved", [schema.int_hash(H2)], "CPU"], ["AllBlocksCleared"]]
