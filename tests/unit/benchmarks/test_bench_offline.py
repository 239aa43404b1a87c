"""The benchmark's static-batching scheduler (benchmarks/bench_offline.py): a batch is
admitted only when nothing runs, and the tokens are the in-flight engine's."""

from backend import LLM
from benchmarks.bench_offline import StaticBatchScheduler, Workload, run_engine
from tests.conftest import assert_pool_free


def test_static_batching_admits_only_when_nothing_runs(llama_ckpt):
    wl = Workload.bimodal(12, (4, 12), (1, 3), (10, 12), 0.3, vocab_size=300, seed=3)
    args = dict(block_size=4, num_kv_blocks=128, max_num_seqs=4, max_num_batched_tokens=64)
    llm = LLM(llama_ckpt, **args)
    llm.engine.scheduler.__class__ = StaticBatchScheduler
    for p, sp in zip(wl.prompts, wl.params()):
        llm.engine.add_request(list(p), sp)
    admitted_while_running = 0
    outs = {}
    while llm.engine.has_unfinished_requests():
        was_running = len(llm.engine.scheduler.running)
        waiting_before = len(llm.engine.scheduler.waiting)
        for o in llm.engine.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
        if was_running and len(llm.engine.scheduler.waiting) < waiting_before:
            admitted_while_running += 1
    assert admitted_while_running == 0 and len(outs) == 12
    assert_pool_free(llm)
    inflight = LLM(llama_ckpt, **args).generate([list(p) for p in wl.prompts], wl.params())
    assert [outs[f"req-{i}"] for i in range(12)] == [o.token_ids for o in inflight]
    static, _ = run_engine(llama_ckpt, wl, static_batching=True, **args)
    assert static.output_tokens == wl.num_output_tokens
