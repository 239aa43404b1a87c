"""A rank other than 0 (a process the engine, or a worker node's agent, starts): builds
its shard (its tensor-parallel slice of its pipeline stage's layers) and KV cache, then
runs each step rank 0 sends, until told to stop or rank 0 goes away: it replays the
step's journal (the typed steps and sampled tokens since the last one) into request
states of its own, builds the step's inputs from them as rank 0 does, and runs the
forward."""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from backend.engine.runner.cuda_graphs import capture_decode_graphs
from backend.engine.host_malloc import keep_large_blocks
from backend.engine.runner.step_inputs import StepInputBuilder
from backend.models.rotary import long_rope
from backend.parallel import step_payload
from backend.parallel.group import control_group, destroy_group, init_group
from backend.parallel.pipeline import PipelineStage, stage_kv_config
from backend.parallel.messages import (HEADER_LEN, CaptureMessage, SetupMessage, StageTimesMessage, StepMessage,
                                       decode)
from backend.parallel.rank_spec import (COLLECTIVE_TIMEOUT_S, WorkerSpec, agree, arrived_key, cpu_share,
                                        kv_bytes, model_bytes)


def worker_main(spec: WorkerSpec) -> None:
    """Entry point of ranks 1..N-1 (a spawned process)."""
    # Imported here: the engine imports this module, and a spawned child imports only what it runs.
    from backend.attention import make_attention_factory
    from backend.config import EngineArgs
    from backend.engine.runner.model_runner import ModelRunner, allocate_kv_cache
    from backend.lora import make_lora_manager
    from backend.models.config import load_model_config
    from backend.models.loader import load_model
    from backend.ops import make_layer_ops
    from backend.parallel.sharding import local_config
    from backend.parallel.moe_sharding import with_expert_parallel

    logging.basicConfig(level=logging.INFO, format=f"[paged_llm rank {spec.rank}] %(message)s")
    device = spec.device()
    if device.type == "cpu":
        torch.set_num_threads(cpu_share(spec.ranks_per_node))
        keep_large_blocks()
    else:
        torch.cuda.set_device(device)
    store = spec.client_store()
    store.set(arrived_key(spec.rank), "1")
    tp = init_group(spec.rank, spec.size, store, device, COLLECTIVE_TIMEOUT_S, spec.tp_size)
    ctrl = control_group()
    try:
        cfg = with_expert_parallel(load_model_config(spec.model), spec.enable_expert_parallel)
        stage = PipelineStage.of(spec.rank, spec.tp_size, spec.pp_size, cfg.num_layers) if spec.pp_size > 1 else None
        model = load_model(spec.model, cfg, getattr(torch, spec.dtype), device,
                           make_attention_factory(spec.attention_backend), spec.max_position,
                           make_layer_ops(spec.attention_backend), tp, stage=stage)
        lora = None
        if spec.lora_engine_args is not None:
            lora = make_lora_manager(EngineArgs(**spec.lora_engine_args), cfg, model, device,
                                     getattr(torch, spec.dtype), spec.attention_backend, spec.rank, spec.size)
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        dist.broadcast(header, 0, group=ctrl)
        setup = decode(header)
        if not isinstance(setup, SetupMessage):
            return
        kv_caches = allocate_kv_cache(stage_kv_config(local_config(cfg, spec.tp_size), stage), setup.num_kv_blocks,
                                      setup.block_size, getattr(torch, spec.kv_dtype), device)
        if spec.kv_cache_scales:            # INT8 cache: this rank's heads of its stage's layers
            from backend.engine.runner.kv_int8 import load_kv_cache_scales, set_kv_cache_scales
            from backend.parallel.sharding import kv_head_range
            scales = load_kv_cache_scales(spec.kv_cache_scales, cfg,
                                          kv_head_range(cfg, spec.rank % spec.tp_size, spec.tp_size))
            set_kv_cache_scales(kv_caches, scales[stage.start_layer:stage.end_layer] if stage else scales)
        original = long_rope(cfg.rope_scaling)
        inputs = StepInputBuilder(setup.max_tokens, setup.max_seqs, setup.max_blocks_per_seq, setup.block_size,
                                  device, long_rope=(original, spec.max_position) if original is not None else None)
        # The runner rank 0 runs, for its forward path (graph replay or eager); this rank
        # never samples, so it has no sampler. Its request states and block tables are
        # its own, kept from rank 0's journal (step_payload.py).
        runner = ModelRunner(model, kv_caches, setup.block_size, device, None, inputs, cfg.vocab_size,
                             lora=lora)
        dist.gather(torch.tensor([model_bytes(model), kv_bytes(kv_caches)], dtype=torch.int64), None,
                    dst=0, group=ctrl)
        # Pipeline bubble timers (StageTimesMessage): time spent waiting for the next step
        # (idle) and, in the stage's forward, for the previous stage's hidden state.
        idle_s, since = 0.0, time.perf_counter()
        with torch.inference_mode():
            while True:
                start = time.perf_counter()
                dist.broadcast(header, 0, group=ctrl)
                idle_s += time.perf_counter() - start
                message = decode(header)
                if isinstance(message, StageTimesMessage):
                    now = time.perf_counter()
                    waited = idle_s + getattr(model, "wait_s", 0.0)
                    dist.gather(torch.tensor([int(waited * 1e9), int((now - since) * 1e9)], dtype=torch.int64),
                                None, dst=0, group=ctrl)
                    if message.reset:
                        idle_s, since = 0.0, now
                        if stage is not None:
                            model.wait_s = 0.0
                    continue
                if isinstance(message, CaptureMessage):
                    graphs = capture_decode_graphs(runner, message.max_num_seqs, message.max_model_len,
                                                   message.verify_query_len)
                    runner.graphs = graphs if agree(graphs is not None, ctrl) else None
                    continue
                if not isinstance(message, StepMessage):
                    return
                payload = torch.empty(message.payload_len, dtype=torch.uint8)
                dist.broadcast(payload, 0, group=ctrl)
                rank_step = step_payload.decode(payload)
                out, states = runner.states.replay(rank_step.journal)
                step = inputs.build(out, states, pad_to=message.graph)
                if inputs.digest() != message.inputs_digest:
                    raise RuntimeError(f"rank {spec.rank} built other step inputs than rank 0 "
                                       f"({len(out.scheduled)} requests): the ranks' request states drifted")
                if rank_step.lora_ids is not None:
                    lora.prepare(lora.names_of(rank_step.lora_ids), [s.num_new_tokens for s in out.scheduled],
                                 message.graph.num_seqs if message.graph is not None else None)
                runner.run_forward(step, message.graph)
    except Exception:
        # Rank 0 sees the closed connections at once; the reason goes to the log.
        logging.getLogger(__name__).exception("rank %d failed", spec.rank)
        raise SystemExit(1)
    finally:
        destroy_group()
