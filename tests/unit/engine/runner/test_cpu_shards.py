"""The CPU forward split by sequences over threads (backend/engine/runner/cpu_shards.py): the
cut, the tokens (transformers' greedy, and the same logprobs and prompt logprobs as one
forward), and where it is refused."""

import itertools
import os
import re
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from backend import LLM, SamplingParams
from backend.attention.metadata import AttentionMetadata
from backend.config import ConfigError
from backend.engine.runner import cpu_shards
from backend.engine.runner.cpu_shards import ShardedForward, sequence_costs, shard_bounds
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import hf_greedy, make_checkpoint
from tests.helpers.threads import on_fresh_thread


def test_shard_bounds_cut_contiguous_runs_of_equal_work():
    costs = lambda q, s: sequence_costs(q, s, 256)                      # noqa: E731
    assert shard_bounds(costs([1] * 8, [10] * 8), 2) == [0, 4, 8]
    # One prefill chunk of 60 tokens weighs about as much as the 60 decode rows after it.
    assert shard_bounds(costs([60] + [1] * 60, [60] + [10] * 60), 2) == [0, 1, 61]
    assert shard_bounds(costs([5], [5]), 2) == [0, 1]                   # one sequence: no cut
    assert shard_bounds(costs([1, 1], [10, 10]), 4) == [0, 1, 2]        # never an empty run
    # Long contexts weigh more: the cut moves toward the long rows.
    b = shard_bounds(costs([1] * 8, [2000] * 4 + [10] * 4), 2)
    assert b[0] == 0 and b[-1] == 8 and b[1] < 4


class _RowIds:
    """A stand-in model whose hidden row t is the packed token index it was given (the
    step's input ids are 0..T-1), recording which thread ran which sequences."""

    def __init__(self):
        self.config = SimpleNamespace(hidden_size=256)
        self.calls = []
        self.threads = []       # intra-op threads of each call on the calling thread

    def __call__(self, input_ids, positions, kv_caches, meta):
        self.calls.append((threading.current_thread().name, len(meta.query_lens_cpu)))
        if threading.current_thread().name == "MainThread":
            self.threads.append(torch.get_num_threads())
        return input_ids.float()[:, None].repeat(1, 3)

    def compute_logits(self, hidden):
        return hidden


def _step(query_lens, seq_lens, rows):
    T, B = sum(query_lens), len(query_lens)
    qsl = torch.tensor([0] + list(itertools.accumulate(query_lens)), dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.zeros(B, 1, dtype=torch.int32), slot_mapping=torch.arange(T),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    return SimpleNamespace(meta=meta, input_ids=torch.arange(T), positions=torch.zeros(T, dtype=torch.int64),
                           logits_indices_cpu=np.asarray(rows, dtype=np.int32), num_logits=len(rows))


@pytest.mark.parametrize("case, where", [
    ("32 decode rows", {"MainThread"}),         # too little work for two shards: inline
    ("128 decode rows", {"cpu-shard"}),         # split
    ("one long prompt", {"cpu-whole"}),         # worth two shards, one sequence: whole
    ("a prompt beside decode rows", {"cpu-whole"}),     # one shard would hold most of it: whole
    ("a chunk beside as much decode work", {"cpu-shard"}),
])
def test_where_a_step_runs_and_its_rows_come_back_in_order(case, where):
    """Default model's shape (hidden 256, 4 layers). Rows of every case come back in the
    step's logits order, prompt-logprob rows (after the sampled ones) included."""
    q, s = {"32 decode rows": ([1] * 32, [64] * 32), "128 decode rows": ([1] * 128, [256] * 128),
            "one long prompt": ([200], [200]), "a prompt beside decode rows": ([200] + [1] * 15, [200] + [250] * 15),
            "a chunk beside as much decode work": ([120] + [1] * 120, [120] + [120] * 120)}[case]
    last = list(itertools.accumulate(q))
    rows = [t - 1 for t in last] + ([0, 30] if case == "128 decode rows" else [0, 1])
    shards = ShardedForward(2, 1, hidden_size=256, num_layers=4)
    model = _RowIds()
    out = on_fresh_thread(lambda: shards(model, [], _step(q, s, rows)))
    shards.close()
    assert {name.split("_")[0] for name, _ in model.calls} == where
    assert len(model.calls) == (2 if where == {"cpu-shard"} else 1)
    assert out[:, 0].tolist() == rows


def test_a_taken_core_runs_steps_whole_until_a_probe_finds_it_free(monkeypatch):
    """Shards that get little CPU for their wall time (another process holds a core):
    the next PROBE_EVERY splittable steps run whole on the calling thread; then one split
    step looks again, and a free machine splits from then on. Rows in order throughout."""
    import time
    monkeypatch.setattr(cpu_shards, "PROBE_EVERY", 3)
    shards = ShardedForward(2, 1, hidden_size=256, num_layers=4)

    class Slow(_RowIds):        # long enough that both pool threads take a shard
        def __call__(self, *args):
            time.sleep(0.005)
            return super().__call__(*args)
    model = Slow()
    q, s, rows = [1] * 128, [256] * 128, list(range(128))

    def where(n):
        seen = []
        for _ in range(n):
            model.calls.clear()
            out = on_fresh_thread(lambda: shards(model, [], _step(q, s, rows)))
            assert out[:, 0].tolist() == rows
            seen.append({name.split("_")[0] for name, _ in model.calls})
        return seen
    # One shard thread is never kept from a core, the other always: the step waits for
    # the slower, which decides.
    taken = {}

    def core_clock():
        me = threading.current_thread().name
        return time.perf_counter() if taken.setdefault("free", me) == me else 0.0
    monkeypatch.setattr(cpu_shards, "_core_clock", core_clock)
    # (an average over steps: the second such step tips it)
    assert where(6) == [{"cpu-shard"}] * 2 + [{"MainThread"}] * 3 + [{"cpu-shard"}]
    assert shards.whole_steps_left == 3                                # the probe found it still taken
    assert model.threads == [1] * len(model.threads)                   # whole steps: the caller's one thread
    monkeypatch.setattr(cpu_shards, "_core_clock", time.perf_counter)   # never kept waiting: free
    assert where(6) == [{"MainThread"}] * 3 + [{"cpu-shard"}] * 3
    assert shards.efficiency > cpu_shards.CONTENDED_EFFICIENCY
    shards.close()
    # Two intra-op threads per shard: not measured, so the rule stays off.
    wide = ShardedForward(2, 2, hidden_size=256, num_layers=4)
    monkeypatch.setattr(cpu_shards, "_core_clock", lambda: 0.0)
    for _ in range(3):
        on_fresh_thread(lambda: wide(model, [], _step(q, s, rows)))
    assert wide.efficiency < cpu_shards.CONTENDED_EFFICIENCY and wide.whole_steps_left == 0
    wide.close()


@pytest.fixture
def counted(monkeypatch):
    """Every step worth two shards (the test models are far below the default's minimum
    work) and split whatever the shards' CPU share and balance; counts the steps that ran
    split."""
    monkeypatch.setattr(cpu_shards, "MIN_SHARD_WORK", 0.0)
    monkeypatch.setattr(cpu_shards, "MAX_SHARD_SHARE", 1.0)
    monkeypatch.setattr(cpu_shards, "CONTENDED_EFFICIENCY", 0.0)
    calls = {"split": 0}
    real = cpu_shards.shard_bounds

    def bounds(*a):
        out = real(*a)
        calls["split"] += len(out) > 2
        return out

    monkeypatch.setattr(cpu_shards, "shard_bounds", bounds)
    return calls


def test_split_forward_matches_transformers_and_one_forward(ckpt_dir, counted):
    """Greedy tokens equal transformers' with chunked prefill and preemption, and
    logprobs and prompt logprobs (rows put back in order) equal those of one forward."""
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    lengths = [1, 90, 7, 40, 33, 60, 2, 25]
    prompts = random_prompts(len(lengths), lengths, seed=3)
    expected = hf_greedy(path, prompts, 16)
    params = [SamplingParams(max_tokens=16, min_tokens=16, temperature=0, logprobs=3,
                             prompt_logprobs=2 if i % 3 == 0 else None) for i in range(len(prompts))]
    results = {}
    for shards in (2, 1):
        llm = LLM(path, device="cpu", block_size=4, num_kv_blocks=80, max_num_seqs=8, max_num_batched_tokens=40,
                  cpu_forward_shards=shards)
        assert (llm.engine.runner.shards is not None) == (shards == 2)
        results[shards] = on_fresh_thread(lambda: llm.generate(prompts, params))
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0
        assert_pool_free(llm)
        llm.engine.shutdown()
    assert counted["split"] > 10
    for i, (split, whole, ref) in enumerate(zip(results[2], results[1], expected)):
        assert split.token_ids == ref, f"prompt {i}"
        assert split.token_ids == whole.token_ids
        for a, b in zip(split.logprobs, whole.logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
        if params[i].prompt_logprobs:
            assert len(split.prompt_logprobs) == len(prompts[i])
            for a, b in zip(split.prompt_logprobs[1:], whole.prompt_logprobs[1:]):
                assert a.keys() == b.keys()
                assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


@pytest.mark.skipif(not cpu_shards._SCHEDSTAT, reason="the kernel gives no scheduler statistics")
def test_the_contention_clock_counts_a_wait_for_a_core_not_a_sleep():
    """The shards' contention measure (_core_clock over wall time): about 1 for a thread
    that sleeps (as one waiting for the GIL does), about a half for a busy thread that
    shares its one core with a busy process. Best of three tries each (a loaded CI
    machine, a CPU quota's throttling)."""
    def ratio(work):
        wall, clock = time.perf_counter(), cpu_shards._core_clock()
        work()
        return (cpu_shards._core_clock() - clock) / (time.perf_counter() - wall)

    def spin(seconds=0.4):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    core = min(os.sched_getaffinity(0))
    # Pinned to the core, it says so, then spins for at most a minute (never outliving a
    # killed test run by long).
    hog = subprocess.Popen([sys.executable, "-S", "-c", (
        f"import os, sys, time; os.sched_setaffinity(0, {{{core}}}); print('pinned', flush=True)\n"
        "end = time.monotonic() + 60\nwhile time.monotonic() < end: pass")], stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout.readline().strip() == "pinned"

        def pinned():
            os.sched_setaffinity(0, {core})          # (this thread only)
            tries = [(ratio(lambda: time.sleep(0.2)), ratio(spin)) for _ in range(3)]
            return max(a for a, _ in tries), min(b for _, b in tries)
        slept, spun = on_fresh_thread(pinned)
    finally:
        hog.kill()
        hog.wait()
        hog.stdout.close()
    assert slept > 0.9
    assert spun < 0.75


def test_a_failed_reading_leaves_the_step_unmeasured(monkeypatch):
    """A clock reading that fails (None) skips that step's measure: the average stays."""
    monkeypatch.setattr(cpu_shards, "_core_clock", lambda: None)
    shards = ShardedForward(2, 1, hidden_size=256, num_layers=4)
    shards.efficiency = 0.9
    q, s, rows = [1] * 128, [256] * 128, list(range(128))
    model = _RowIds()
    out = on_fresh_thread(lambda: shards(model, [], _step(q, s, rows)))
    shards.close()
    assert out[:, 0].tolist() == rows and {name.split("_")[0] for name, _ in model.calls} == {"cpu-shard"}
    assert shards.efficiency == 0.9 and shards.whole_steps_left == 0


def test_default_is_two_shards_on_cpu_with_two_threads_and_weights_in_cache(ckpt_dir, monkeypatch):
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    monkeypatch.setattr(cpu_shards, "intra_op_threads", lambda: 2)
    llm = LLM(path, device="cpu", block_size=8, num_kv_blocks=16)
    assert llm.engine.runner.shards.num_shards == 2 and llm.engine.runner.shards.threads_per_shard == 1
    llm.engine.shutdown()
    monkeypatch.setattr(cpu_shards, "intra_op_threads", lambda: 1)
    assert LLM(path, device="cpu", block_size=8, num_kv_blocks=16).engine.runner.shards is None
    # Weights past the last-level cache: each shard would stream them from memory again.
    monkeypatch.setattr(cpu_shards, "intra_op_threads", lambda: 2)
    monkeypatch.setattr(cpu_shards, "last_level_cache_bytes", lambda: 1 << 10)
    assert LLM(path, device="cpu", block_size=8, num_kv_blocks=16).engine.runner.shards is None
    llm = LLM(path, device="cpu", block_size=8, num_kv_blocks=16, cpu_forward_shards=2)      # asked for: split
    assert llm.engine.runner.shards.num_shards == 2
    llm.engine.shutdown()


def test_last_level_cache_size_is_read_or_defaults():
    assert cpu_shards.last_level_cache_bytes() >= 1 << 20


def test_the_calling_thread_runs_its_share_and_gets_its_count_back(ckpt_dir, monkeypatch):
    """The engine's thread runs its own ops (the sampler, small steps) with one shard's
    share of intra-op threads, a step too small to share with one (cpu_threads.py);
    `generate` gives the user's thread its count back when it returns."""
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    seen = {}

    def generate(sampling: list) -> None:
        llm = LLM(path, device="cpu", block_size=8, num_kv_blocks=64, cpu_forward_shards=2)
        real_sample = llm.engine.runner.sample
        llm.engine.runner.sample = lambda launched, grammar_bitmask=None: (
            sampling.append(torch.get_num_threads()), real_sample(launched, grammar_bitmask))
        llm.generate(random_prompts(4, [5, 9, 3, 7], seed=0), SamplingParams(max_tokens=4, temperature=0))
        assert_pool_free(llm)
        llm.engine.shutdown()

    def engine_thread():
        torch.set_num_threads(2)
        small, split = [], []
        generate(small)                                 # too little work to split: one thread
        monkeypatch.setattr(cpu_shards, "MIN_SHARD_WORK", 0.0)
        generate(split)
        seen.update(small_steps=set(small), split_steps=set(split), after=torch.get_num_threads(),
                    before=cpu_shards.intra_op_threads())

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    assert seen == {"small_steps": {1}, "split_steps": {1}, "after": 2, "before": 2}


def test_shard_threads_keep_their_count_whatever_another_thread_sets_later():
    """ATen sets a thread's count lazily from the value set last by any thread: a pool
    thread settles its own at start, so the engine's later set_num_threads (the offline
    API's restore) cannot raise it."""
    def probe():
        shards = ShardedForward(2, 1, hidden_size=256, num_layers=4)
        shards._pool.submit(lambda: None).result()      # the pool's first thread starts
        torch.set_num_threads(2)
        count = shards._pool.submit(torch.get_num_threads).result()
        shards.close()
        return count
    assert on_fresh_thread(probe) == 1


def test_a_failing_shard_waits_for_the_others_before_raising():
    """A shard that raises must not leave another still writing the step's K/V."""
    done = []

    class Failing(_RowIds):
        def __call__(self, input_ids, positions, kv_caches, meta):
            if int(input_ids[0]) == 0:
                raise RuntimeError("shard 0 failed")
            time.sleep(0.3)
            done.append(True)
            return super().__call__(input_ids, positions, kv_caches, meta)

    shards = ShardedForward(2, 1, hidden_size=256, num_layers=4)
    q = [1] * 128
    err = on_fresh_thread(lambda: _raised(lambda: shards(Failing(), [], _step(q, [256] * 128, list(range(128))))))
    shards.close()
    assert "shard 0 failed" in str(err) and done == [True]


def _raised(fn):
    try:
        fn()
    except Exception as e:      # noqa: BLE001 - the test inspects it
        return e
    return None


@pytest.mark.parametrize("args, named", [
    (dict(runner="pooling"), "runner='pooling'"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size=2"),
    (dict(device="cuda"), "device='cuda'"),
])
def test_refused_where_it_cannot_run_before_anything_loads(args, named):
    """Checked with the other engine arguments, before the model loads or ranks start."""
    from backend.config import EngineArgs
    with pytest.raises(ConfigError, match=f"cpu_forward_shards=2 is not supported where {re.escape(named)}"):
        EngineArgs.create(model="/nonexistent", cpu_forward_shards=2, **args)


def test_refused_with_lora(ckpt_dir):
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    with pytest.raises(ConfigError, match="cpu_forward_shards"):
        LLM(path, device="cpu", block_size=8, num_kv_blocks=16, enable_lora=True, cpu_forward_shards=2)
