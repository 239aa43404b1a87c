"""CUDA-graph decode, the parts a CPU can check: the size ladder, bucket choice, which
steps qualify, padded inputs in the fixed buffers, the check against eager, and the
whole engine serving through the graph path with a stand-in graph that recomputes over
exactly the buffers a captured graph reads (Triton kernels, interpreter)."""

import logging

import numpy as np
import pytest
import torch

from backend import LLM, SamplingParams
from backend.engine.cuda_graphs import (_check_against_eager, capture_decode_graphs,
                                        capture_sizes, estimate_graph_bytes, graph_size_for, is_decode_only)
from backend.engine.scheduler import ScheduledRequest, SchedulerOutput
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import hf_greedy, make_checkpoint
from tests.helpers.graphs import EagerReplayGraphs


def test_capture_sizes_ladder():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1) == [1]


def test_smallest_graph_that_fits():
    sizes = capture_sizes(64)
    assert [graph_size_for(n, sizes) for n in (1, 3, 8, 9, 17, 64)] == [1, 4, 8, 16, 32, 64]
    assert graph_size_for(65, sizes) is None


class _Req:
    def __init__(self, computed, total):
        self.num_computed_tokens, self.num_tokens = computed, total
        self.num_output_placeholders = 0


def test_only_decode_steps_qualify():
    decode = SchedulerOutput([ScheduledRequest(_Req(9, 10), 1), ScheduledRequest(_Req(0, 1), 1)])
    chunk = SchedulerOutput([ScheduledRequest(_Req(9, 10), 1), ScheduledRequest(_Req(0, 40), 1)])
    prefill = SchedulerOutput([ScheduledRequest(_Req(9, 10), 1), ScheduledRequest(_Req(0, 5), 5)])
    assert is_decode_only(decode)
    assert not is_decode_only(chunk) and not is_decode_only(prefill) and not is_decode_only(SchedulerOutput())


def test_graph_memory_is_reserved_in_the_plan(llama_ckpt):
    from backend.models.config import load_model_config
    cfg = load_model_config(llama_ckpt)
    small, big = estimate_graph_bytes(cfg, 8, 2), estimate_graph_bytes(cfg, 64, 2)
    assert 0 < small < big and big >= 64 * cfg.vocab_size * 2


def test_engine_through_padded_graph_path_matches_transformers(ckpt_dir):
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    prompts = random_prompts(5, [1, 30, 9, 23, 17], seed=3)
    expected = hf_greedy(path, prompts, 6)
    llm = LLM(path, block_size=8, num_kv_blocks=40, max_num_seqs=6, max_num_batched_tokens=32,
              attention_backend="triton")
    runner = llm.engine.runner
    runner.graphs = EagerReplayGraphs(runner, 6)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, min_tokens=6, temperature=0))
    assert [o.token_ids for o in outs] == expected
    assert 8 not in runner.graphs.replayed and 6 in runner.graphs.replayed   # 5 sequences padded to 6
    assert_pool_free(llm)


def test_padded_inputs_overwrite_stale_rows(llama_ckpt):
    llm = LLM(llama_ckpt, block_size=4, num_kv_blocks=64, max_num_seqs=8, enforce_eager=True)
    engine = llm.engine
    b = engine.runner.inputs
    for p in random_prompts(8, [3, 6], seed=0):
        engine.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()                                   # an 8-sequence prefill fills the buffers
    for rid in list(engine.scheduler.requests)[:3]:
        engine.abort_request(rid)
    sched = engine.scheduler.schedule()
    assert len(sched.scheduled) == 5 and is_decode_only(sched)
    addresses = [b.device_view(n, 1).data_ptr() for n in b.offsets]
    step = b.build(sched, engine.kv_cache.block_table, pad_to=8)
    assert [b.device_view(n, 1).data_ptr() for n in b.offsets] == addresses
    dev = {n: b.device_view(n, 9).cpu().numpy() for n in ("slot_mapping", "seq_lens", "query_start_loc", "input_ids")}
    assert (dev["slot_mapping"][5:8] == -1).all() and (dev["slot_mapping"][:5] >= 0).all()
    assert (dev["seq_lens"][5:8] == 0).all() and (dev["input_ids"][5:8] == 0).all()
    assert dev["query_start_loc"].tolist() == [0, 1, 2, 3, 4, 5, 5, 5, 5]
    assert step.num_seqs == 5 and step.input_ids.shape[0] == 8
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    assert_pool_free(engine)


def test_graph_disagreeing_with_eager_is_refused(llama_ckpt):
    llm = LLM(llama_ckpt, block_size=4, num_kv_blocks=16, max_num_seqs=4, attention_backend="triton")
    runner = llm.engine.runner

    class Wrong(EagerReplayGraphs):
        def replay(self, size):
            return super().replay(size).flip(0) if size > 1 else super().replay(size)
    rng = np.random.default_rng(0)
    splits = {s: 2 for s in capture_sizes(4)}
    assert _check_against_eager(EagerReplayGraphs(runner, 4), runner, rng, splits) is None
    msg = _check_against_eager(Wrong(runner, 4), runner, rng, splits)
    assert msg is not None and "batch size 2" in msg


def test_capture_failure_leaves_the_engine_eager(llama_ckpt, caplog):
    llm = LLM(llama_ckpt, block_size=4, num_kv_blocks=16, max_num_seqs=4, device="cpu")
    assert not llm.engine.use_cuda_graphs and llm.engine.runner.graphs is None   # CPU: never captured
    with caplog.at_level(logging.WARNING):
        assert capture_decode_graphs(llm.engine.runner, 4, 64) is None          # a CPU runner cannot capture
    assert "running eagerly" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures real CUDA graphs")
def test_captured_graphs_serve_the_eager_tokens(llama_ckpt):
    """On a GPU: fp32, TF32 off; graphs and enforce_eager give the same greedy tokens."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = random_prompts(7, [3, 40, 17], seed=5)
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)
    runs = []
    for eager in (False, True):
        llm = LLM(llama_ckpt, dtype="float32", device="cuda", block_size=8, num_kv_blocks=64, max_num_seqs=8,
                  attention_backend="triton", enforce_eager=eager)
        assert (llm.engine.runner.graphs is None) == eager
        runs.append([o.token_ids for o in llm.generate(prompts, params)])
        assert_pool_free(llm)
    assert runs[0] == runs[1]
