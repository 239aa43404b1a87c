"""backend/engine/kv_events/collector.py: what the engine thread records between two
flushes, and how: stored runs kept whole, a step's evictions folded into one removal per
tier, removals silenced while the pool clears (one AllBlocksCleared stands for them), and
a step's events handed to the publisher in one batch, once."""

from types import SimpleNamespace

from backend.engine.kv_events.collector import DEVICE, HOST, KVEventCollector, lora_id


class Publisher:
    def __init__(self) -> None:
        self.batches: list[list[tuple]] = []
        self.closed = False

    def publish(self, events: list[tuple]) -> None:
        self.batches.append(events)

    def close(self) -> None:
        self.closed = True


def test_a_steps_evictions_fold_into_one_event_per_tier():
    pub = Publisher()
    c = KVEventCollector(16, pub)
    c.stored([b"a", b"b"], None, list(range(32)))
    c.removed(b"x")
    c.removed(b"y")
    c.removed(b"z", HOST)           # another tier: an event of its own
    c.removed(b"w", HOST)
    c.removed(b"v")                 # back to the device: a new event (order kept)
    c.flush()
    assert pub.batches == [[("stored", [b"a", b"b"], None, list(range(32)), DEVICE, None),
                            ("removed", [b"x", b"y"], DEVICE), ("removed", [b"z", b"w"], HOST),
                            ("removed", [b"v"], DEVICE)]]


def test_an_empty_run_is_not_an_event_and_an_empty_step_publishes_nothing():
    pub = Publisher()
    c = KVEventCollector(16, pub)
    c.stored([], b"p", [])
    c.flush()
    assert pub.batches == []
    c.stored([b"h"], b"p", [1, 2, 3, 4], HOST, lora_id=7)
    c.flush()
    c.flush()                       # nothing new: nothing sent twice
    assert pub.batches == [[("stored", [b"h"], b"p", [1, 2, 3, 4], HOST, 7)]]


def test_clearing_stands_for_every_removal_until_it_ends():
    pub = Publisher()
    c = KVEventCollector(16, pub)
    c.removed(b"before")
    c.clearing(True)
    c.removed(b"during-1")
    c.removed(b"during-2", HOST)
    c.clearing(False)
    c.removed(b"after")
    c.flush()
    assert pub.batches == [[("removed", [b"before"], DEVICE), ("cleared",), ("removed", [b"after"], DEVICE)]]


def test_shutdown_sends_what_is_queued_then_closes():
    pub = Publisher()
    c = KVEventCollector(16, pub)
    c.removed(b"last")
    c.shutdown()
    assert pub.batches == [[("removed", [b"last"], DEVICE)]] and pub.closed


def test_lora_id_is_63_bits_of_the_salt_and_only_for_adapters():
    salt = bytes(range(200, 232))
    assert lora_id(salt) == int.from_bytes(salt[:8], "big") >> 1 < 2 ** 63
    assert lora_id(None) is None and lora_id(b"") is None
    request = SimpleNamespace(cache_salt=salt, sampling_params=SimpleNamespace(lora_name="a"))
    assert KVEventCollector.lora_id(request) == lora_id(salt)
    # A salt without an adapter (a request's own cache_salt) is not an adapter's id.
    request.sampling_params.lora_name = None
    assert KVEventCollector.lora_id(request) is None
