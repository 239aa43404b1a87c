"""Our engine as a Dynamo worker: registered with Dynamo's discovery, serving its
token-level generate stream, relaying its KV events and publishing its load.

The engine is the same one Triton's adapter runs (EngineLoop over LLMEngine, built from
the same model repository entry); Dynamo is another front door. Its KV events go out
on the engine's own ZMQ publisher (backend/engine/kv_events/, vLLM's schema) and
Dynamo's KvEventPublisher relays them to its event plane, as Dynamo's vLLM worker does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from backend.config import EngineArgs, validated, ConfigError
from backend.dynamo_worker.protocol import BadRequest, chunk_from, sampling_params_from
from backend.engine.engine_loop import EngineLoop
from backend.engine.llm_engine import LLMEngine
from backend.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

# How often the worker's load (KV blocks in use, requests) goes to Dynamo's router.
LOAD_PERIOD_S = 0.5


@dataclass(frozen=True)
class WorkerOptions:
    served_model_name: str
    namespace: str = "dynamo"
    component: str = "backend"
    endpoint: str = "generate"
    discovery_backend: str = "etcd"
    request_plane: str = "tcp"
    event_plane: Optional[str] = None


def with_kv_events(args: EngineArgs) -> EngineArgs:
    """The entry's engine arguments with KV events on (Dynamo's KV router reads them):
    the entry's own kv_events_config when it enables them, else a private ipc:// socket."""
    if not args.enable_prefix_caching:
        raise ConfigError("enable_prefix_caching: the Dynamo worker's KV routing needs the prefix cache on")
    events = args.kv_events_config
    if events is not None and events.enable_kv_cache_events and events.publisher == "zmq":
        return args
    path = os.path.join(tempfile.mkdtemp(prefix="paged-llm-kv-"), "events")
    return validated(EngineArgs, ConfigError, "argument", **{
        **args.model_dump(exclude_unset=True),
        "kv_events_config": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{path}"}})


class GenerateHandler:
    """Dynamo's generate endpoint over an EngineLoop: one PreprocessedRequest in, its
    chunks out. A request whose client goes (or that Dynamo stops) is aborted, so its
    blocks go back to the pool."""

    def __init__(self, loop: EngineLoop, max_model_len: int) -> None:
        self.loop = loop
        self.max_model_len = max_model_len
        self.num_finished = 0
        self.num_cancelled = 0      # by their client's going or Dynamo's stop

    async def generate(self, request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        try:
            params = sampling_params_from(request, self.max_model_len)
            if params.n != 1:
                raise BadRequest("n: Dynamo's frontend asks a worker for one sequence at a time (n=1)")
        except BadRequest as e:
            yield {"index": 0, "token_ids": [], "finish_reason": f"error: {e}"}
            return
        request_id = f"dyn-{uuid.uuid4().hex}"
        aloop = asyncio.get_running_loop()
        queue: "asyncio.Queue[RequestOutput]" = asyncio.Queue()
        self.loop.add_request(list(request["token_ids"]), params, request_id,
                              lambda out: aloop.call_soon_threadsafe(queue.put_nowait, out))
        stopper = aloop.create_task(self._abort_when_stopped(context, request_id)) if context is not None else None
        finished = False
        finish_reason: Optional[str] = None
        num_output_tokens = 0
        try:
            while not finished:
                out = await queue.get()
                finished, finish_reason = out.finished, out.finish_reason
                num_output_tokens += len(out.new_token_ids)
                chunk = chunk_from(out, num_output_tokens)
                if chunk is not None:
                    yield chunk
        finally:
            if stopper is not None:
                stopper.cancel()
            if not finished:        # the consumer went away (a client disconnect): free its blocks
                self.loop.abort(request_id)
            cancelled = not finished or finish_reason == "abort"
            if cancelled:
                logger.info("aborted %s after %d tokens: its client went away", request_id, num_output_tokens)
            self.num_cancelled += cancelled
            self.num_finished += not cancelled

    async def _abort_when_stopped(self, context: Any, request_id: str) -> None:
        await context.async_killed_or_stopped()
        self.loop.abort(request_id)


async def publish_load(engine: LLMEngine, publisher: Any) -> None:
    """KV blocks in use, for the router's load term (Dynamo's WorkerMetricsPublisher)."""
    while True:
        stats = engine.stats()
        publisher.publish(kv_used_blocks=stats["num_used_blocks"],
                          active_decode_blocks=stats["num_used_blocks"])
        await asyncio.sleep(LOAD_PERIOD_S)


async def serve(engine_args: EngineArgs, checkpoint_dir: str, options: WorkerOptions) -> None:
    """Start the engine, register it with Dynamo and serve until the runtime shuts down."""
    from dynamo.llm import (KvEventPublisher, ModelInput, ModelRuntimeConfig, ModelType,
                            WorkerMetricsPublisher, WorkerType, register_model)
    from dynamo.runtime import DistributedRuntime

    engine_args = with_kv_events(engine_args)
    engine = LLMEngine(engine_args)
    loop = EngineLoop(engine).start()
    stats = engine.stats()
    aloop = asyncio.get_running_loop()
    runtime = DistributedRuntime(aloop, options.discovery_backend, options.request_plane,
                                 event_plane=options.event_plane)
    endpoint = runtime.endpoint(f"{options.namespace}.{options.component}.{options.endpoint}")

    runtime_config = ModelRuntimeConfig()
    runtime_config.context_length = stats["max_model_len"]
    runtime_config.total_kv_blocks = stats["num_total_blocks"]
    runtime_config.max_num_seqs = engine_args.max_num_seqs
    runtime_config.max_num_batched_tokens = engine_args.max_num_batched_tokens
    runtime_config.kv_event_publishing_enabled = True
    await register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, endpoint, checkpoint_dir,
                         options.served_model_name, worker_type=WorkerType.Aggregated,
                         kv_cache_block_size=engine_args.block_size, runtime_config=runtime_config)
    events = engine_args.kv_events_config
    kv_publisher = KvEventPublisher(endpoint=endpoint, kv_block_size=engine_args.block_size,
                                    zmq_endpoint=events.endpoint, zmq_topic=events.topic)
    load_publisher = WorkerMetricsPublisher()
    await load_publisher.create_endpoint(endpoint)
    load_task = aloop.create_task(publish_load(engine, load_publisher))
    handler = GenerateHandler(loop, stats["max_model_len"])
    logger.info("serving %s as %s.%s.%s (%d KV blocks of %d tokens)", options.served_model_name,
                options.namespace, options.component, options.endpoint, stats["num_total_blocks"],
                engine_args.block_size)
    try:
        await endpoint.serve_endpoint(handler.generate)
    finally:
        load_task.cancel()
        kv_publisher.shutdown()
        runtime.shutdown()
        loop.stop(grace_period_s=0.0)
        stats = engine.stats()
        # (what a deployment's logs and the tests read: nothing left holding blocks)
        logger.info("stopped: KV blocks in use at exit: %d of %d; requests finished: %d, cancelled: %d",
                    stats["num_used_blocks"], stats["num_total_blocks"], handler.num_finished,
                    handler.num_cancelled)
