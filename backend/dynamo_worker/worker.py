"""Our engine as a Dynamo worker: registered with Dynamo's discovery, serving its
token-level generate stream (handlers.py), relaying its KV events and publishing its
load. As a prefill or decode worker (`disaggregation_mode`, Dynamo's name) it also
runs a NIXL agent over its paged cache (backend/engine/kv_transfer/).

The engine is the same one Triton's adapter runs (EngineLoop over LLMEngine, built from
the same model repository entry); Dynamo is another front door. Its KV events go out
on the engine's own ZMQ publisher (backend/engine/kv_events/, vLLM's schema) and
Dynamo's KvEventPublisher relays them to its event plane, as Dynamo's vLLM worker does.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from backend.config import ConfigError, EngineArgs, validated
from backend.dynamo_worker.handlers import GenerateHandler, PrefillHandler
from backend.engine.engine_loop import EngineLoop
from backend.engine.llm_engine import LLMEngine

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
    # "aggregated", or Dynamo's disaggregated roles "prefill" and "decode".
    disaggregation_mode: str = "aggregated"
    on_loopback: bool = True            # (Dynamo's planes, and so the handoffs, stay on this machine)


# The key prefill and decode workers sign and check handoffs with (disagg.py).
KEY_VARIABLE = "PAGED_LLM_KV_TRANSFER_KEY"


def with_kv_events(args: EngineArgs) -> EngineArgs:
    """The entry's engine arguments with KV events on (Dynamo's KV router reads them):
    the entry's own kv_events_config when it enables them, else a private ipc:// socket."""
    if not args.enable_prefix_caching:
        raise ConfigError("enable_prefix_caching: the Dynamo worker's KV routing needs the prefix cache on")
    events = args.kv_events_config
    if events is not None and events.enable_kv_cache_events and events.publisher == "zmq":
        return args
    folder = tempfile.mkdtemp(prefix="paged-llm-kv-")
    atexit.register(shutil.rmtree, folder, True)        # (each run left its socket's folder behind)
    path = os.path.join(folder, "events")
    return validated(EngineArgs, ConfigError, "argument", **{
        **args.model_dump(exclude_unset=True),
        "kv_events_config": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{path}"}})


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

    from backend.engine.kv_transfer.disagg import KVReceiver, KVSender, transport_for

    mode = options.disaggregation_mode
    engine_args = with_kv_events(engine_args)
    engine = LLMEngine(engine_args)
    loop = EngineLoop(engine).start()
    stats = engine.stats()
    sender = receiver = None
    if mode != "aggregated":
        transport = transport_for(loop, f"{options.served_model_name}-{mode}-{uuid.uuid4().hex[:12]}")
        secret = os.environ.get(KEY_VARIABLE, "").encode() or None
        if secret is None and not options.on_loopback:
            logger.warning("%s is not set: a decode worker reads KV blocks from whatever agent a request on "
                           "Dynamo's request plane names; set the same key on every prefill and decode worker",
                           KEY_VARIABLE)
        sender = KVSender(loop, transport, secret=secret) if mode == "prefill" else None
        receiver = KVReceiver(loop, transport, secret=secret) if mode == "decode" else None
    handler = PrefillHandler(loop, sender) if sender is not None else GenerateHandler(loop, receiver)
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
    # As Dynamo's vLLM worker registers each role: a prefill worker has no OpenAI surface
    # (the legacy ModelType.Prefill marks it), and each role needs the other to serve.
    model_type, worker_type, needs = {
        "aggregated": (ModelType.Chat | ModelType.Completions, WorkerType.Aggregated, []),
        "prefill": (ModelType.Prefill, WorkerType.Prefill, [[WorkerType.Decode]]),
        "decode": (ModelType.Chat | ModelType.Completions, WorkerType.Decode, [[WorkerType.Prefill]]),
    }[mode]
    await register_model(ModelInput.Tokens, model_type, endpoint, checkpoint_dir, options.served_model_name,
                         worker_type=worker_type, needs=needs, kv_cache_block_size=engine_args.block_size,
                         runtime_config=runtime_config)
    for adapter in sorted(engine.lora.names if engine.lora is not None else ()):
        # Each LoRA adapter of the entry is a model of its own to Dynamo, as its vLLM worker
        # registers them; a request for it names it as its model (handlers.py).
        await register_model(ModelInput.Tokens, model_type, endpoint, checkpoint_dir, worker_type=worker_type,
                             needs=needs, kv_cache_block_size=engine_args.block_size, runtime_config=runtime_config,
                             lora_name=adapter, base_model_path=checkpoint_dir, ignore_weights=True)
    events = engine_args.kv_events_config
    kv_publisher = KvEventPublisher(endpoint=endpoint, kv_block_size=engine_args.block_size,
                                    zmq_endpoint=events.endpoint, zmq_topic=events.topic)
    load_publisher = WorkerMetricsPublisher()
    await load_publisher.create_endpoint(endpoint)
    load_task = aloop.create_task(publish_load(engine, load_publisher))
    logger.info("serving %s as %s.%s.%s (%s; %d KV blocks of %d tokens)", options.served_model_name,
                options.namespace, options.component, options.endpoint, mode, stats["num_total_blocks"],
                engine_args.block_size)
    try:
        await endpoint.serve_endpoint(handler.generate)
    finally:
        load_task.cancel()
        kv_publisher.shutdown()
        runtime.shutdown()
        if sender is not None:
            sender.stop()
            try:
                loop.call(lambda: engine.handoff.expire(float("inf"))).result()     # nothing waits for them now
            except Exception as e:      # (the engine died: its blocks go with it)
                logger.warning("could not release the blocks kept for decode workers: %s", e)
        loop.stop(grace_period_s=0.0)
        stats = engine.stats()
        # (what a deployment's logs and the tests read: nothing left holding blocks)
        logger.info("stopped: KV blocks in use at exit: %d of %d; requests finished: %d, cancelled: %d; "
                    "preemptions: %d; KV blocks received: %d, prompts computed here instead: %d",
                    stats["num_used_blocks"], stats["num_total_blocks"], handler.counts.num_finished,
                    handler.counts.num_cancelled, stats["num_preemptions"],
                    receiver.num_received_blocks if receiver else 0, receiver.num_fallbacks if receiver else 0)
