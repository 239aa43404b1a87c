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

import hashlib
import hmac
import json
import logging
import threading
import time
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
    prefix caching on, one rank, no draft model, no sliding windows, no LongRoPE)."""
    engine = loop.engine
    if engine.handoff is None:
        raise ValueError("prefill/decode disaggregation needs enable_prefix_caching, one rank "
                         "(tensor_parallel_size and pipeline_parallel_size 1), no draft model, no "
                         "kv_offloading_size, and a model without sliding windows or LongRoPE")
    return NixlTransport(name, engine.runner.kv_caches)


def tokens_digest(token_ids: list[int]) -> str:
    """What the kept blocks hold: a digest of the tokens they were computed for."""
    return hashlib.sha256(json.dumps(list(token_ids)).encode()).hexdigest()


def _signature(params: dict, secret: bytes) -> str:
    """An HMAC over what the decode side acts on: which agent it reads from, where, which
    blocks of which tokens, until when."""
    fields = {k: params.get(k) for k in ("engine_id", "agent_metadata", "bases", "block_bytes", "layout",
                                         "mem_type", "device_id", "remote_block_ids", "remote_request_id",
                                         "expires_at", "tokens_digest")}
    return hmac.new(secret, json.dumps(fields, sort_keys=True).encode(), hashlib.sha256).hexdigest()


class KVSender:
    """`secret`: a key shared with the decode engines (PAGED_LLM_KV_TRANSFER_KEY); with it
    every handoff is signed, so a decode engine reads only from prefill engines that
    hold the key."""

    def __init__(self, loop: EngineLoop, transport: NixlTransport, poll_s: float = 0.005,
                 secret: Optional[bytes] = None) -> None:
        self.loop = loop
        self.transport = transport
        self.secret = secret
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
        nothing, lists no blocks, and the decode engine computes it. `expires_at` (wall
        clock) is when this engine lets the blocks go unclaimed."""
        kept = out.kv_transfer_params or {"remote_block_ids": [], "num_remote_tokens": 0}
        params = {"do_remote_prefill": True, "remote_request_id": request_id, **kept, **self.transport.descriptor(),
                  "expires_at": time.time() + self.loop.engine.handoff.timeout_s,
                  "tokens_digest": tokens_digest(out.prompt_token_ids[:kept["num_remote_tokens"]])}
        if self.secret:
            params["signature"] = _signature(params, self.secret)
        return params

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
    """`secret`: with it, only handoffs signed with the same key are read (the others are
    computed here)."""

    def __init__(self, loop: EngineLoop, transport: NixlTransport,
                 timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S, secret: Optional[bytes] = None) -> None:
        self.loop = loop
        self.transport = transport
        self.timeout_s = timeout_s
        self.secret = secret
        self.num_received_blocks = 0
        self.num_fallbacks = 0
        self._seen: dict[str, float] = {}         # handoffs read, until they expire: each is read once
        self._seen_lock = threading.Lock()

    def _refusal(self, token_ids: list[int], kv_params: dict) -> Optional[str]:
        if self.secret and not hmac.compare_digest(str(kv_params.get("signature", "")).encode(),
                                                   _signature(kv_params, self.secret).encode()):
            return "its handoff is not signed with this deployment's key (PAGED_LLM_KV_TRANSFER_KEY)"
        num_tokens = kv_params.get("num_remote_tokens")
        digest = kv_params.get("tokens_digest")
        if (self.secret or digest is not None) and (not isinstance(num_tokens, int) or
                                                    digest != tokens_digest(token_ids[:num_tokens])):
            return "its blocks were computed for another prompt"
        expires_at = kv_params.get("expires_at")
        if isinstance(expires_at, (int, float)) and time.time() + self.timeout_s > expires_at:
            return "the prefill engine lets its blocks go before a copy could finish"
        with self._seen_lock:
            now = time.time()
            self._seen = {rid: t for rid, t in self._seen.items() if t > now}
            rid = str(kv_params.get("remote_request_id"))
            if rid in self._seen:
                return "this handoff was read already"
            self._seen[rid] = expires_at if isinstance(expires_at, (int, float)) else now + 3600
        return None

    def _copy_time(self, kv_params: dict) -> float:
        """At most the time limit, and never past the blocks' expiry (less a margin)."""
        expires_at = kv_params.get("expires_at")
        if not isinstance(expires_at, (int, float)):
            return self.timeout_s
        return max(0.0, min(self.timeout_s, expires_at - time.time() - 1.0))

    def receive(self, token_ids: list[int], params: SamplingParams, kv_params: dict) -> int:
        """Bring in the prompt's blocks the prefill engine kept (blocking: call it off the
        event loop). Returns how many blocks were copied; 0 means the prompt is computed
        here (nothing to copy, or a failure, logged). Never raises for the copy."""
        engine = self.loop.engine
        remote_ids = list(kv_params.get("remote_block_ids") or [])
        if not remote_ids:
            return 0                    # (nothing was kept: nothing to release either)
        release = RELEASE + str(kv_params.get("remote_request_id", "")).encode()
        ticket = None
        try:
            refusal = self._refusal(token_ids, kv_params)
            if refusal is not None:
                return self._fall_back(kv_params, refusal, notify=False)
            ticket = self.loop.call(lambda: engine.reserve_import(token_ids, params, len(remote_ids))).result()
            if ticket is None or not ticket.blocks:
                self.transport.notify(kv_params, release)
                return 0
            if ticket.ready is not None:
                ticket.ready.synchronize()
            wanted = remote_ids[ticket.num_cached:ticket.num_cached + len(ticket.blocks)]
            self.transport.read(kv_params, wanted, ticket.block_ids, self._copy_time(kv_params), notification=release)
        except Exception as e:          # (any failure: the prompt is computed here)
            if ticket is not None and ticket.blocks:
                reusable = not isinstance(e, TransferError) or e.blocks_reusable
                end = engine.handoff.abort_import if reusable else engine.handoff.quarantine_import
                self.loop.call(lambda: end(ticket)).result()
            return self._fall_back(kv_params, str(e) or type(e).__name__, notify=True, release=release)
        self.loop.call(lambda: engine.handoff.commit_import(ticket)).result()
        self.num_received_blocks += len(ticket.blocks)
        return len(ticket.blocks)

    def _fall_back(self, kv_params: dict, why: str, notify: bool, release: bytes = b"") -> int:
        logger.warning("computing the prompt here: its KV blocks could not be brought from %s: %s",
                       kv_params.get("engine_id"), why)
        self.num_fallbacks += 1
        if notify:
            self.transport.notify(kv_params, release)
        return 0
