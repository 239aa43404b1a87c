"""KV cache events (backend/engine/kv_events/, vLLM's kv_events_config): a subscriber
written against vLLM's own schema (its examples/online_serving/kv_events_subscriber.py
types, copied below) receives over ZMQ a BlockStored for every block the prefix cache
takes, with the pool's own chained hashes and the prompt's token ids; a BlockRemoved for
every eviction; AllBlocksCleared on a reset. The hashes are the same on two replicas of
one model; the host tier's blocks come with medium "CPU"; the endpoint stays on this
machine."""

import time
from typing import Any, Optional, Union

import pytest

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from backend import LLM, SamplingParams  # noqa: E402
from backend.engine.scheduling.block_pool import hash_block  # noqa: E402
from tests.conftest import assert_pool_free  # noqa: E402
from tests.helpers.checkpoints import make_checkpoint  # noqa: E402


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Optional[Union[bytes, int]]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


BLOCK = 4
PROMPT = list(range(20, 37))        # 17 tokens: 4 full blocks
GREEDY = SamplingParams(max_tokens=3, min_tokens=3, temperature=0)


@pytest.fixture(scope="module")
def base(ckpt_dir):
    return make_checkpoint(str(ckpt_dir / "llama"), "llama")


def engine_with_events(base, **kw):
    cfg = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0", "topic": "kv-events",
           **kw.pop("events", {})}
    llm = LLM(base, block_size=BLOCK, num_kv_blocks=kw.pop("num_kv_blocks", 16), kv_events_config=cfg, **kw)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(llm.engine.kv_events.publisher.endpoint)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    time.sleep(0.3)                 # (a PUB drops what it sends before the subscription arrives)
    return llm, sub


def receive(sub, until, timeout_s=10.0):
    """Decoded events, in order, until `until(events)`; and the sequence numbers seen."""
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    events, seqs = [], []
    deadline = time.monotonic() + timeout_s
    while not until(events):
        assert time.monotonic() < deadline, events
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv-events"
            seqs.append(int.from_bytes(seq, "big"))
            events += decoder.decode(payload).events
    return events, seqs


def stored(events):
    return [e for e in events if isinstance(e, BlockStored)]


def test_stored_removed_and_cleared_in_vllms_schema(base):
    llm, sub = engine_with_events(base)
    llm.generate([PROMPT], GREEDY)
    events, seqs = receive(sub, lambda ev: sum(len(e.block_hashes) for e in stored(ev)) >= 4)
    assert seqs == list(range(len(seqs)))                  # no gap
    first = stored(events)[0]
    assert first.parent_block_hash is None and first.block_size == BLOCK and first.medium == "GPU"
    assert first.token_ids == PROMPT[:4 * len(first.block_hashes)]
    hashes = [h for e in stored(events) for h in e.block_hashes]
    chain, parent = [], None                    # the prefix cache's own chained hashes
    for i in range(4):
        parent = hash_block(parent, PROMPT[i * BLOCK:(i + 1) * BLOCK])
        chain.append(parent)
    assert all(h in llm.engine.kv_cache.pool.cached for h in chain)
    # As vLLM sends them by default (and Dynamo reads them): 64-bit ints, the last 8 bytes.
    assert hashes[:4] == [int.from_bytes(h[-8:], "big") for h in chain] and all(h < 2**64 for h in hashes)
    # Other prompts fill the 16 blocks: the first prompt's blocks are evicted.
    llm.generate([list(range(100 + 17 * i, 117 + 17 * i)) for i in range(3)], GREEDY)
    events, _ = receive(sub, lambda ev: any(isinstance(e, BlockRemoved) for e in ev))
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert set(removed) <= set(hashes) | {h for e in stored(events) for h in e.block_hashes} and removed
    llm.engine.kv_cache.reset_prefix_cache()
    llm.engine.after_step()
    events, _ = receive(sub, lambda ev: any(isinstance(e, AllBlocksCleared) for e in ev))
    assert not any(isinstance(e, BlockRemoved) for e in events[events.index(next(
        e for e in events if isinstance(e, AllBlocksCleared))):])      # one event stands for them all
    assert_pool_free(llm)
    llm.engine.shutdown()


def test_whole_hashes_on_request_and_adapters_named_by_lora_id(base, tmp_path):
    """`block_hash_format: bytes` sends the 32-byte hashes; an adapter's blocks carry a
    lora_id (the same for the same adapter files), the base model's none."""
    from tests.helpers.adapters import make_adapter
    adapter = make_adapter(base, str(tmp_path / "a"), rank=4, alpha=8, seed=3)
    llm, sub = engine_with_events(base, events={"block_hash_format": "bytes"}, lora_modules={"a": adapter},
                                  max_lora_rank=8)
    llm.generate([PROMPT], GREEDY)
    llm.generate([PROMPT], SamplingParams(max_tokens=3, min_tokens=3, temperature=0, lora_name="a"))
    events, _ = receive(sub, lambda ev: sum(len(e.block_hashes) for e in stored(ev)) >= 8)
    base_events = [e for e in stored(events) if e.lora_id is None]
    lora_events = [e for e in stored(events) if e.lora_id is not None]
    assert base_events and lora_events and all(isinstance(h, bytes) and len(h) == 32
                                               for e in stored(events) for h in e.block_hashes)
    assert lora_events[0].parent_block_hash is None and 0 < lora_events[0].lora_id < 2**63
    assert not {h for e in base_events for h in e.block_hashes} & {h for e in lora_events for h in e.block_hashes}
    llm.engine.shutdown()


def test_hashes_are_the_same_on_two_replicas(base):
    seen = []
    for _ in range(2):
        llm, sub = engine_with_events(base)
        llm.generate([PROMPT], GREEDY)
        events, _ = receive(sub, lambda ev: sum(len(e.block_hashes) for e in stored(ev)) >= 4)
        seen.append([h for e in stored(events) for h in e.block_hashes][:4])
        llm.engine.shutdown()
    assert seen[0] == seen[1] and len(set(seen[0])) == 4


def test_the_host_tier_publishes_its_blocks_as_cpu(base):
    plain = LLM(base, block_size=BLOCK, num_kv_blocks=16)
    size = 64 * plain.engine.stats()["kv_cache_bytes"] // 16 / 2**30
    llm, sub = engine_with_events(base, kv_offloading_size=size)
    llm.generate([PROMPT, list(range(60, 77))], GREEDY)
    llm.generate([[5, 6, 7]], GREEDY)              # a step after: the last saves go out
    events, _ = receive(sub, lambda ev: sum(len(e.block_hashes) for e in stored(ev) if e.medium == "CPU") >= 8)
    device = {h for e in stored(events) if e.medium == "GPU" for h in e.block_hashes}
    host = {h for e in stored(events) if e.medium == "CPU" for h in e.block_hashes}
    assert host <= device and len(host) >= 8
    # A prompt's first block starts its chain there too (its parent is no block).
    firsts = {e.block_hashes[0] for e in stored(events) if e.medium == "GPU" and e.parent_block_hash is None}
    assert all(e.parent_block_hash is None for e in stored(events) if e.medium == "CPU" and e.block_hashes[0] in firsts)
    assert any(e.block_hashes[0] in firsts for e in stored(events) if e.medium == "CPU")
    llm.engine.shutdown()


def test_the_endpoint_stays_on_this_machine(base):
    from backend.config import EngineArgs
    for endpoint in ("tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://10.0.0.3:5557"):
        with pytest.raises(ValueError, match="is not on this machine"):
            EngineArgs(model=base, kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint})
    for endpoint in ("tcp://127.0.0.1:5557", "tcp://[::1]:5557", "ipc:///tmp/kv-events"):
        assert EngineArgs(model=base, kv_events_config=f'{{"endpoint": "{endpoint}"}}').kv_events_config.endpoint \
            == endpoint


def test_a_subscriber_that_missed_batches_gets_them_from_the_replay_socket(base):
    """vLLM's replay protocol: [empty, start sequence] to the ROUTER, then each buffered
    batch from there as [empty, sequence, batch], and [empty, -1, empty] to end."""
    cfg = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0",
           "buffer_steps": 100}
    llm = LLM(base, block_size=BLOCK, num_kv_blocks=16, kv_events_config=cfg)
    for start in (20, 60, 100):                     # three batches, before anyone subscribed
        llm.generate([list(range(start, start + 17))], GREEDY)
    publisher = llm.engine.kv_events.publisher
    deadline = time.monotonic() + 10
    while publisher.num_published < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    replay = zmq.Context.instance().socket(zmq.DEALER)
    replay.connect(publisher.replay_endpoint)
    replay.send_multipart([b"", (1).to_bytes(8, "big")])
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    seqs = []
    while True:
        assert replay.poll(5000)
        _, seq, payload = replay.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            assert payload == b""
            break
        seqs.append(int.from_bytes(seq, "big"))
        decoder.decode(payload)
    assert seqs == list(range(1, publisher.num_published))
    with pytest.raises(ValueError, match="is not on this machine"):
        from backend.config import EngineArgs
        EngineArgs(model=base, kv_events_config={**cfg, "replay_endpoint": "tcp://*:5558"})
    llm.engine.shutdown()
