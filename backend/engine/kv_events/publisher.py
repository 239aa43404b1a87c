"""Publishes KV event batches over ZMQ as vLLM's ZmqEventPublisher does: a PUB socket,
each message three frames (topic, sequence number as 8 big-endian bytes, the msgpack
batch). Subscribers detect gaps by the sequence number and ask the replay socket (a
ROUTER, with `replay_endpoint`) for what they missed: a request of [empty, start
sequence] gets every batch still buffered from there, as [empty, sequence, batch], then
[empty, -1, empty] (vLLM's end marker). The last `buffer_steps` batches are buffered.

The socket lives on a thread of its own. The engine thread only puts each step's batch
on a bounded queue, and a full queue drops the batch with a warning: a slow subscriber
never slows the engine. ZMQ's high-water mark bounds what waits for subscribers.

The endpoint must be on this machine (a loopback address or `ipc://`): the events carry
prompts' token ids, and a ZMQ port takes no key. A router on another machine relays
through Dynamo's publisher (NATS, with its own authentication) rather than a port opened
to the network.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Optional

logger = logging.getLogger(__name__)


class ZmqEventPublisher:
    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, endpoint: str, topic: str, block_size: int, hwm: int = 100_000,
                 max_queue_size: int = 100_000, replay_endpoint: Optional[str] = None,
                 buffer_steps: int = 10_000, int_hashes: bool = True) -> None:
        import zmq                      # (optional dependencies: only with kv_events_config)
        from msgspec.msgpack import Encoder
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._replay = None
        self.replay_endpoint = None
        try:
            self._socket.setsockopt(zmq.SNDHWM, hwm)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.bind(endpoint)
            self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)    # (a port of 0 chosen)
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception:               # (a port taken: the sockets go, the error names it)
            self._socket.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            raise
        self._int_hashes = int_hashes
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._topic = topic.encode()
        self._block_size = block_size
        self._encoder = Encoder()
        self._queue: "queue.Queue[Optional[tuple[float, list]]]" = queue.Queue(max_queue_size)
        self.num_published = 0
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[tuple]) -> None:
        """From the engine thread: never blocks."""
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped in (1, 10, 100) or self.num_dropped % 1000 == 0:
                logger.warning("KV events: the publisher's queue is full; %d batches dropped", self.num_dropped)

    def _run(self) -> None:
        from backend.engine.kv_events.schema import encode_batch
        seq = 0
        while True:
            try:
                item = self._queue.get(timeout=0.05 if self._replay is not None else None)
            except queue.Empty:
                item = ()
            if item is None:
                break
            if item:
                ts, events = item
                try:
                    payload = encode_batch(self._encoder, ts, events, self._block_size, self._int_hashes)
                    self._socket.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
                    self._buffer.append((seq, payload))
                    seq += 1
                    self.num_published += 1
                except Exception:
                    logger.exception("KV events: a batch could not be published")
            try:
                while self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
            except Exception:
                logger.exception("KV events: a replay request failed")
        self._socket.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: a replay request of %d frames ignored (want: empty, 8-byte sequence)",
                           len(frames) - 1)
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([client, b"", self.END_SEQ, b""])

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then close the socket (never waits past timeout_s)."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            logger.warning("KV events: the publisher did not drain its queue; closing without it")
        self._thread.join(timeout_s)
