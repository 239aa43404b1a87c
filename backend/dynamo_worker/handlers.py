"""Dynamo's generate endpoint over an EngineLoop, for each role a worker plays.

- `GenerateHandler` (aggregated and decode workers): one PreprocessedRequest in, its
  chunks out. On a decode worker the request comes with the prefill worker's
  `prefill_result`; its blocks are brought in first (KVReceiver), and the prompt is
  computed here when they cannot be.
- `PrefillHandler` (prefill workers): the prompt only, one token; the reply's
  `disaggregated_params.kv_transfer_params` tell the decode worker where the blocks are,
  as Dynamo's vLLM prefill worker says it.

A request whose client goes (or that Dynamo stops) is aborted, so its blocks go back to
the pool.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from backend.dynamo_worker.protocol import BadRequest, chunk_from, sampling_params_from, usage_of
from backend.engine.engine_loop import EngineLoop
from backend.engine.kv_transfer.disagg import KVReceiver, KVSender
from backend.engine.outputs import RequestOutput
from backend.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class Counts:
    """Requests a worker finished and cancelled (its exit log line says them)."""
    num_finished: int = 0
    num_cancelled: int = 0


async def engine_outputs(loop: EngineLoop, token_ids: list[int], params: SamplingParams, request_id: str,
                         context: Any, counts: Counts) -> AsyncIterator[RequestOutput]:
    """The request's outputs as the engine makes them, until the final one; aborted if
    the consumer stops early or Dynamo stops the request."""
    aloop = asyncio.get_running_loop()
    queue: "asyncio.Queue[RequestOutput]" = asyncio.Queue()
    loop.add_request(token_ids, params, request_id, lambda out: aloop.call_soon_threadsafe(queue.put_nowait, out))
    stopper = aloop.create_task(_abort_when_stopped(loop, context, request_id)) if context is not None else None
    finished, finish_reason, num_tokens = False, None, 0
    try:
        while not finished:
            out = await queue.get()
            finished, finish_reason = out.finished, out.finish_reason
            num_tokens += len(out.new_token_ids)
            yield out
    finally:
        if stopper is not None:
            stopper.cancel()
        if not finished:        # the consumer went away (a client disconnect): free its blocks
            loop.abort(request_id)
        cancelled = not finished or finish_reason == "abort"
        if cancelled:
            logger.info("aborted %s after %d tokens: its client went away", request_id, num_tokens)
        counts.num_cancelled += cancelled
        counts.num_finished += not cancelled


async def _abort_when_stopped(loop: EngineLoop, context: Any, request_id: str) -> None:
    await context.async_killed_or_stopped()
    loop.abort(request_id)


class _Handler:
    """Dynamo's `generate` for one role: the request's sampling parameters checked here
    (a bad one is one `error:` chunk), the role's work in `serve`. A request for one of
    the engine's LoRA adapters names it as its model (Dynamo registers each adapter as a
    model of its own)."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop
        self.counts = Counts()

    async def generate(self, request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        try:
            params = sampling_params_from(request, self.loop.engine.max_model_len)
            if params.n != 1:
                raise BadRequest("n: Dynamo's frontend asks a worker for one sequence at a time (n=1)")
            lora = self.loop.engine.lora
            if lora is not None and request.get("model") in lora.names:     # (read each time: it changes)
                params = params.model_copy(update={"lora_name": request["model"]})
        except BadRequest as e:
            yield {"index": 0, "token_ids": [], "finish_reason": f"error: {e}"}
            return
        async for chunk in self.serve(list(request["token_ids"]), params, request, context):
            yield chunk

    def serve(self, token_ids: list[int], params: SamplingParams, request: dict[str, Any],
              context: Any) -> AsyncIterator[dict[str, Any]]:
        raise NotImplementedError


class GenerateHandler(_Handler):
    # Copies in progress at once (each waits on its own thread, up to its time limit);
    # more wait their turn without holding the event loop's default pool.
    MAX_COPIES = 4

    def __init__(self, loop: EngineLoop, receiver: Optional[KVReceiver] = None) -> None:
        super().__init__(loop)
        self.receiver = receiver
        self._copies = ThreadPoolExecutor(self.MAX_COPIES, thread_name_prefix="kv-receive") if receiver else None

    async def serve(self, token_ids, params, request, context):
        prefill = ((request.get("prefill_result") or {}).get("disaggregated_params") or {})
        kv_params = prefill.get("kv_transfer_params")
        if kv_params and self.receiver is not None:
            await asyncio.get_running_loop().run_in_executor(self._copies, self.receiver.receive, token_ids, params,
                                                             kv_params)
        num_output_tokens = 0
        async for out in engine_outputs(self.loop, token_ids, params, f"dyn-{uuid.uuid4().hex}", context,
                                        self.counts):
            num_output_tokens += len(out.new_token_ids)
            chunk = chunk_from(out, num_output_tokens)
            if chunk is not None:
                yield chunk


class PrefillHandler(_Handler):
    def __init__(self, loop: EngineLoop, sender: KVSender) -> None:
        super().__init__(loop)
        self.sender = sender

    async def serve(self, token_ids, params, request, context):
        request_id = f"dyn-prefill-{uuid.uuid4().hex}"
        async for out in engine_outputs(self.loop, token_ids, KVSender.prefill_params(params), request_id,
                                        context, self.counts):
            if not out.finished:
                continue
            if out.error is not None:
                yield {"index": 0, "token_ids": [], "finish_reason": f"error: {out.error}"}
                return
            yield {"index": 0, "token_ids": list(out.token_ids),
                   "disaggregated_params": {"kv_transfer_params": self.sender.handoff_params(request_id, out)},
                   "completion_usage": usage_of(out, len(out.token_ids))}
