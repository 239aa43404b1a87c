"""Prefill/decode disaggregation between two engines, whatever routes the requests
(Dynamo's disaggregated mode: backend/dynamo_worker/).

Prefill engine (`KVSender`): a request runs with `max_tokens=1` and
`kv_transfer_params={"do_remote_decode": true}`; when it finishes, its computed full
blocks stay held (scheduling/kv_handoff.py) and `handoff_params` says where they are:
this engine's transport descriptor, the block ids, the request id. A notification
`release:<request id>` from the decode engine (sent when its copy is done, or when it
gives up) frees them; otherwise they expire.

Decode engine (`KVReceiver`): before the request is added, `receive` reserves blocks for
the prompt's full blocks it lacks, copies them from the prefill engine, and commits them
to its prefix cache; the request then hits them. Any failure (the prefill engine gone,
a slow copy, a layout that differs, no room) gives the blocks back and leaves the
prompt to be computed here: the request never fails for it.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

from backend.engine.engine_loop import EngineLoop
from backend.engine.kv_transfer.nixl_transport import NixlTransport, TransferError
from backend.engine.outputs import RequestOutput
from backend.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

RELEASE = b"release:"
DEFAULT_TRANSFER_TIMEOUT_S = 10.0


def transport_for(loop: EngineLoop, name: str) -> NixlTransport:
    """This engine's NIXL agent over its paged cache (disaggregation needs the handoff:
    prefix caching on, one rank, no draft model)."""
    engine = loop.engine
    if engine.handoff is None:
        raise ValueError("prefill/decode disaggregation needs enable_prefix_caching, one rank "
                         "(tensor_parallel_size and pipeline_parallel_size 1) and no draft model")
    return NixlTransport(name, engine.runner.kv_caches)


class KVSender:
    def __init__(self, loop: EngineLoop, transport: NixlTransport, poll_s: float = 0.005) -> None:
        self.loop = loop
        self.transport = transport
        self._poll_s = poll_s
        loop.call(loop.engine.handoff.start_holding).result()       # (this engine is a prefill engine now)
        self._stop = threading.Event()
        self.num_released = 0
        self._thread = threading.Thread(target=self._listen, name="kv-sender", daemon=True)
        self._thread.start()

    @staticmethod
    def prefill_params(params: SamplingParams) -> SamplingParams:
        """The prompt only: one token, and its blocks kept for the decode engine."""
        return params.model_copy(update={"max_tokens": 1, "min_tokens": 0, "n": 1,
                                         "kv_transfer_params": {"do_remote_decode": True}})

    def handoff_params(self, request_id: str, out: RequestOutput) -> dict:
        """What the decode engine needs to read the finished request's blocks. Always a
        dict (Dynamo requires one): a prompt under one block, or an engine that kept
        nothing, lists no blocks, and the decode engine computes it."""
        kept = out.kv_transfer_params or {"remote_block_ids": [], "num_remote_tokens": 0}
        return {"do_remote_prefill": True, "remote_request_id": request_id, **kept, **self.transport.descriptor()}

    def _listen(self) -> None:
        while not self._stop.wait(self._poll_s):
            for message in self.transport.notifications():
                if message.startswith(RELEASE):
                    request_id = message[len(RELEASE):].decode(errors="replace")
                    self.loop.call(lambda rid=request_id: self.loop.engine.handoff.release(rid))
                    self.num_released += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class KVReceiver:
    def __init__(self, loop: EngineLoop, transport: NixlTransport,
                 timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S) -> None:
        self.loop = loop
        self.transport = transport
        self.timeout_s = timeout_s
        self.num_received_blocks = 0
        self.num_fallbacks = 0

    def receive(self, token_ids: list[int], params: SamplingParams, kv_params: dict) -> int:
        """Bring in the prompt's blocks the prefill engine kept (blocking: call it off the
        event loop). Returns how many blocks were copied; 0 means the prompt is computed
        here (nothing to copy, or a failure, logged)."""
        engine = self.loop.engine
        remote_ids = list(kv_params.get("remote_block_ids") or [])
        if not remote_ids:
            return 0                    # (nothing was kept: nothing to release either)
        release = RELEASE + str(kv_params.get("remote_request_id", "")).encode()
        ticket = None
        try:
            ticket = self.loop.call(lambda: engine.reserve_import(token_ids, params, len(remote_ids))).result()
            if ticket is None or not ticket.blocks:
                self.transport.notify(kv_params, release)
                return 0
            wanted = remote_ids[ticket.num_cached:ticket.num_cached + len(ticket.blocks)]
            self.transport.read(kv_params, wanted, ticket.block_ids, self.timeout_s, notification=release)
        except (TransferError, KeyError, TypeError, ValueError) as e:
            logger.warning("computing the prompt here: its KV blocks could not be brought from %s: %s",
                           kv_params.get("engine_id"), e)
            self.num_fallbacks += 1
            if ticket is not None and ticket.blocks:
                self.loop.call(lambda: engine.handoff.abort_import(ticket)).result()
            self.transport.notify(kv_params, release)
            return 0
        self.loop.call(lambda: engine.handoff.commit_import(ticket)).result()
        self.num_received_blocks += len(ticket.blocks)
        return len(ticket.blocks)
