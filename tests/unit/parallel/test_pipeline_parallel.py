"""pipeline_parallel_size on CPU (gloo between processes): the layers split into stages
(3 layers over 2 stages: 2 + 1), tied embeddings (the last stage holds its own head),
the one scheduler's block ids on every stage, hidden states and residuals sent from
stage to stage; alone and with tensor parallelism inside each stage (4 ranks). The
greedy tokens equal transformers' (so one rank's), with chunked prefill, preemption and
prefix hits, P micro-batches in flight by default (batch_queue.py: they overlap, and a
request is preempted while its batch is in flight) and one when asked; each rank's
weight and KV bytes equal the planner's."""

import os
import signal
import threading
import time

import pytest

from backend import LLM, EngineArgs, SamplingParams
from backend.config import ConfigError
from backend.models.config import load_model_config
from backend.parallel.pipeline import get_pp_indices
from builder import plan
from builder.build import BuildError, BuildOptions, build, engine_parameters
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import hf_greedy, make_checkpoint

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0)
BLOCK = 4


def test_layer_split_build_options_and_config_errors(ckpt_dir, tmp_path):
    # vLLM's split: the extra layers go to the stages before the last (it runs the head).
    assert [get_pp_indices(3, s, 2) for s in range(2)] == [(0, 2), (2, 3)]
    assert [get_pp_indices(10, s, 4) for s in range(4)] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert [get_pp_indices(8, s, 4) for s in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    for bad, field in [(dict(pipeline_parallel_size=2, enable_lora=True), "pipeline_parallel_size=2"),
                       (dict(pipeline_parallel_size=2, async_scheduling=True), "async_scheduling"),
                       (dict(pipeline_parallel_size=0), "pipeline_parallel_size"),
                       (dict(pipeline_parallel_size=2, max_concurrent_batches=3), "max_concurrent_batches=3"),
                       (dict(pipeline_parallel_size=3, nnodes=2), "nnodes=2")]:
        with pytest.raises(ConfigError, match=field):
            EngineArgs.create(model="m", **bad)
    assert not EngineArgs.create(model="m", pipeline_parallel_size=2).use_async_scheduling
    # vLLM's max_concurrent_batches: P by default, one without pipeline parallelism.
    assert EngineArgs.create(model="m", pipeline_parallel_size=2).num_batches_in_flight == 2
    assert EngineArgs.create(model="m").num_batches_in_flight == 1
    # builder build: written to config.pbtxt like tensor_parallel_size, checked against the layers.
    path = make_checkpoint(str(ckpt_dir / "pp_qwen2_3l"), "qwen2", num_hidden_layers=3)
    opts = BuildOptions.create(checkpoint=path, output=str(tmp_path / "e"), pipeline_parallel_size=2, nnodes=2)
    params = engine_parameters(opts, path)
    assert (params["pipeline_parallel_size"], params["nnodes"]) == (2, 2)
    with pytest.raises(BuildError, match="'pipeline_parallel_size': 4 .3 layers cannot make 4 stages"):
        build(BuildOptions.create(checkpoint=path, output=str(tmp_path / "f"), pipeline_parallel_size=4),
              log=lambda *_: None, progress=False)


def _expected_bytes(cfg, tp: int, pp: int, blocks: int) -> list[tuple[int, int]]:
    """Every rank's (weight bytes, KV bytes) as the planner gives them, rank 0 first."""
    return [(plan.weight_bytes(cfg, "float32", tp, stage), blocks * BLOCK * plan.kv_bytes_per_token(cfg, "float32", tp,
                                                                                                  stage))
            for stage in plan.stages(cfg, tp, pp) for _ in range(tp)]


def _launches_past_a_busy_stage(llm, prompts, expected) -> None:
    """Rank 0 launches two batches while stage 1 cannot take anything (its process
    stopped): no send of rank 0's waits for a busy stage (gloo's would: its send and
    broadcast root wait for the receiver). Then the tokens are still transformers'."""
    engine, worker = llm.engine, llm.engine.workers.procs[0]
    requests = [engine.add_request(p, GREEDY) for p in prompts]
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        stepping = threading.Thread(target=lambda: [engine.step() for _ in range(2)], daemon=True)
        stepping.start()        # launch B0; launch B1, then wait for B0's logits
        deadline = time.monotonic() + 30
        while len(engine.batch_queue.queue) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(engine.batch_queue.queue) == 2, "rank 0 waited for the stopped stage"
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    stepping.join(60)
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.output_token_ids for r in requests] == expected


def test_pipeline_stages_give_the_single_rank_greedy_tokens(ckpt_dir):
    # Qwen2: tied embeddings, qkv bias; 3 layers: an uneven split.
    path = make_checkpoint(str(ckpt_dir / "pp_qwen2_3l"), "qwen2", num_hidden_layers=3)
    cfg = load_model_config(path)
    prompts = random_prompts(5, [1, 70, 7, 50, 30], seed=1)
    prompts.append(prompts[1][:60] + [5, 6, 7])          # shares 15 full blocks with prompt 1
    expected = hf_greedy(path, prompts, MAX_NEW)
    for tp, pp, budget, batches in [(1, 2, 100_000, None), (1, 2, 100_000, 1), (2, 2, 50_000, None)]:
        # The KV budget is rank 0's (stage 0: 2 layers); 48 blocks of 4 tokens cannot hold
        # the six sequences at once: preemption, chunked prefill (32-token budget), hits.
        # With two micro-batches in flight the request preempted is in the batch in flight.
        with LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, block_size=BLOCK,
                 kv_cache_memory_bytes=budget, max_num_seqs=8, max_num_batched_tokens=32, dtype="float32",
                 max_concurrent_batches=batches) as llm:
            sched, in_flight_preempted = llm.engine.scheduler, []
            preempt = sched._preempt
            sched._preempt = lambda r, *a: (in_flight_preempted.append(r.request_id in sched.in_flight), preempt(r, *a))
            outs = llm.generate(prompts, GREEDY)
            for i, (out, ref) in enumerate(zip(outs, expected)):
                assert out.token_ids == ref, f"tp={tp} pp={pp}: prompt {i} (len {len(prompts[i])}) differs"
            stats = llm.stats()
            assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0, stats
            if batches is None:         # P batches in flight: launched while another was in flight
                assert stats["max_concurrent_batches"] == pp
                assert stats["num_overlapped_batches"] > stats["num_batches"] // 2, stats
                assert any(in_flight_preempted), in_flight_preempted
                if tp == 1:
                    _launches_past_a_busy_stage(llm, prompts[:2], expected[:2])
            else:
                assert "num_overlapped_batches" not in stats
            assert stats["prefix_cache_hit_tokens"] >= 60
            blocks = plan.kv_blocks(budget, cfg, "float32", BLOCK, tp, plan.stages(cfg, tp, pp)[0])
            assert stats["num_total_blocks"] == blocks
            assert stats["bytes_per_rank"] == _expected_bytes(cfg, tp, pp, blocks)
            print(f"tp={tp} pp={pp}: (weight, KV) bytes per rank {stats['bytes_per_rank']}")
            # Each rank's bubble timers (seconds waiting on other ranks, seconds since reset).
            times = llm.engine.workers.stage_times(llm.engine.model)
            assert len(times) == tp * pp and all(0 <= w <= t for w, t in times), times
            assert_pool_free(llm)
