"""KV cache sizing (backend/engine/sizing.py, profile_run.py): the arithmetic with fake
memory figures, the profile's bookkeeping over a fake device, and the profile step itself
run on the CPU. No GPU here: the CUDA path's figures are never real in these tests."""

import numpy as np
import pytest
import torch

from backend import LLM
from backend.config import ConfigError, EngineArgs
from backend.engine import sizing
from backend.engine.runner.profile_run import dummy_requests, measure, prefill_step, split_tokens
from backend.engine.sampling.sampler import Sampler
from backend.engine.sizing import MemoryProfile, blocks_from_budget, cuda_kv_budget, penalty_table_bytes

GIB = 1 << 30
CUDA = torch.device("cuda")        # a device name only: nothing is allocated on it


def test_budget_is_a_share_of_total_memory_not_of_free():
    # 80 GiB device, 20 GiB in use (so 60 free), 5 GiB activation peak, 0.9.
    p = MemoryProfile(total=80 * GIB, in_use=20 * GIB, activation_peak=5 * GIB)
    budget = cuda_kv_budget(p, 0.9)
    assert budget == int(80 * GIB * 0.9) - 20 * GIB - 5 * GIB      # 47 GiB
    assert budget != int(60 * GIB * 0.9) - 5 * GIB                  # what a share of free would give


def test_activation_peak_and_reserved_bytes_are_subtracted():
    base = cuda_kv_budget(MemoryProfile(80 * GIB, 20 * GIB, 0), 0.9)
    assert cuda_kv_budget(MemoryProfile(80 * GIB, 20 * GIB, 3 * GIB), 0.9) == base - 3 * GIB
    assert cuda_kv_budget(MemoryProfile(80 * GIB, 20 * GIB, 3 * GIB), 0.9, reserved=GIB) == base - 4 * GIB


def test_refuses_when_nothing_is_left_for_the_kv_cache():
    p = MemoryProfile(total=80 * GIB, in_use=30 * GIB, activation_peak=10 * GIB)
    with pytest.raises(ConfigError) as e:
        cuda_kv_budget(p, 0.5)             # 40 GiB share, 40 GiB used
    msg = str(e.value)
    assert "gpu_memory_utilization" in msg and "0.5" in msg
    assert "80.00 GiB" in msg and "30.00 GiB" in msg and "10.00 GiB" in msg
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        cuda_kv_budget(MemoryProfile(80 * GIB, 75 * GIB, 0), 0.9)


def test_what_others_held_at_startup_is_not_the_engines():
    """vLLM's rule: the share is the engine's own. Two engines of 0.45 share one device:
    the second finds 40 GiB in use at startup (the first engine), loads 10 GiB more, and
    gets 36 - 10 GiB, not 36 - 50 (a refusal)."""
    second = MemoryProfile(total=80 * GIB, in_use=50 * GIB, activation_peak=GIB, baseline_in_use=40 * GIB)
    assert second.engine_in_use == 10 * GIB
    assert cuda_kv_budget(second, 0.45) == int(80 * GIB * 0.45) - 10 * GIB - GIB
    with pytest.raises(ConfigError, match="10.00 GiB held by the engine"):
        cuda_kv_budget(MemoryProfile(80 * GIB, 50 * GIB, GIB, baseline_in_use=40 * GIB), 0.12)


def test_startup_refuses_a_share_that_is_not_free():
    """What others hold is checked once, before loading: the share must be free then."""
    sizing.check_startup_memory(free=40 * GIB, total=80 * GIB, gpu_memory_utilization=0.45)   # 36 <= 40
    with pytest.raises(ConfigError) as e:
        sizing.check_startup_memory(free=8 * GIB, total=80 * GIB, gpu_memory_utilization=0.9)
    msg = str(e.value)
    assert "'gpu_memory_utilization'" in msg and "72.00 GiB requested" in msg and "8.00 GiB is free" in msg


def _largest(shapes) -> int:
    """Token rows of the largest graph of a ladder."""
    return max(shape.num_tokens for shape in shapes)


def _cfg(tiny_ckpt):
    from backend.models.config import load_model_config
    return load_model_config(tiny_ckpt)


def test_blocks_on_cuda_come_from_the_profile(tiny_ckpt):
    cfg = _cfg(tiny_ckpt)
    args = EngineArgs.create(model=tiny_ckpt, gpu_memory_utilization=0.5, max_num_seqs=64)
    p = MemoryProfile(total=8 * GIB, in_use=GIB, activation_peak=GIB // 2)
    bpb = 1 << 20
    expect = (4 * GIB - GIB - GIB // 2 - penalty_table_bytes(64, cfg.vocab_size)) // bpb
    assert blocks_from_budget(args, cfg, CUDA, torch.bfloat16, False, bpb, p) == expect
    with_graphs = blocks_from_budget(args, cfg, CUDA, torch.bfloat16, True, bpb, p)
    assert with_graphs < expect                                      # the graphs' pool reserved too
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        blocks_from_budget(args.model_copy(update={"gpu_memory_utilization": 0.1}), cfg, CUDA, torch.bfloat16,
                           False, bpb, p)
    with pytest.raises(ValueError, match="memory profile"):
        blocks_from_budget(args, cfg, CUDA, torch.bfloat16, False, bpb, None)


def test_explicit_budget_and_cpu_are_unchanged(tiny_ckpt):
    cfg = _cfg(tiny_ckpt)
    args = EngineArgs.create(model=tiny_ckpt)
    assert blocks_from_budget(args, cfg, torch.device("cpu"), torch.float32, False, 1 << 20) == 1024
    explicit = args.model_copy(update={"kv_cache_memory_bytes": 10 << 20})
    assert blocks_from_budget(explicit, cfg, CUDA, torch.bfloat16, True, 1 << 20) == 10     # no profile needed
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes"):
        blocks_from_budget(explicit, cfg, torch.device("cpu"), torch.float32, False, 11 << 20)


@pytest.mark.parametrize("max_num_seqs", [1, 8, 9, 64, 100])
def test_penalty_table_bytes_match_the_sampler_grown_to_max_num_seqs(max_num_seqs):
    vocab = 50
    sampler = Sampler(0, torch.device("cpu"), max_num_seqs)
    reqs = dummy_requests([3] * max_num_seqs, max_num_seqs, vocab, 5, np.random.default_rng(0))
    sampler.prepare(reqs, vocab)
    sampler.prepare(reqs, vocab)            # a second step grows nothing
    tables = sampler.penalties
    assert tables.seen.numel() + 4 * tables.counts.numel() == penalty_table_bytes(max_num_seqs, vocab)


class FakeMemory:
    """A device whose allocator the test drives: alloc/free move `allocated`, the peak
    follows, and the driver's free memory is what is not allocated less `other`."""

    def __init__(self, total: int, other: int) -> None:
        self.total, self.other = total, other
        self.now = self.peak = 0
        self.calls: list[str] = []

    def alloc(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)

    def info(self):
        return self.total - self.now - self.other, self.total

    def allocated(self):
        return self.now

    def max_allocated(self):
        return self.peak

    def reset_peak(self):
        self.calls.append("reset_peak")
        self.peak = self.now

    def release(self):
        self.calls.append("release")


def test_measure_counts_only_what_the_step_allocates_above_its_start():
    mem = FakeMemory(total=100, other=7)
    mem.alloc(30)                           # the weights

    def setup():
        mem.alloc(10)                       # the profile's own KV cache: not activations

        def step():
            mem.alloc(25)                   # activations...
            mem.alloc(-20)                  # ... mostly freed; 5 stay (a workspace)
            return "out"
        return step

    # measure releases after setup, after the step, and after dropping the step: by the
    # third the profile's KV cache is freed, before the driver is read.
    orig, released = mem.release, []

    def release():
        orig()
        released.append(1)
        if len(released) == 3:
            mem.alloc(-10)
    mem.release = release
    p = measure(mem, setup)
    assert p.activation_peak == 25
    assert p.total == 100 and p.in_use == 30 + 5 + 7      # weights, what stayed, other processes
    assert p.profiled


@pytest.mark.parametrize("tokens, seqs", [(64, 8), (5, 8), (37, 4)])
def test_profile_step_runs_on_the_cpu(llama_ckpt, tokens, seqs):
    """The same step the CUDA profile runs, on the CPU: a prefill of max_num_batched_tokens
    over up to max_num_seqs sequences, the sampler at max_num_seqs rows with penalties and
    logprobs. (Its memory figures on CUDA are not checked here: no GPU.)"""
    llm = LLM(llama_ckpt, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
              max_num_seqs=seqs, max_num_batched_tokens=tokens)
    eng = llm.engine
    lengths = split_tokens(tokens, seqs)
    assert sum(lengths) == tokens and len(lengths) == min(tokens, seqs) and max(lengths) - min(lengths) <= 1
    mem = FakeMemory(total=1 << 40, other=0)
    p = measure(mem, prefill_step(eng.model, eng.args, torch.float32, eng.device, eng.model_config.vocab_size))
    assert mem.calls.count("reset_peak") == 1
    assert p.activation_peak == 0       # the fake allocator saw nothing: the step ran to its end

    step = prefill_step(eng.model, eng.args, torch.float32, eng.device, eng.model_config.vocab_size)()
    packed = step()
    k = eng.args.max_logprobs
    assert packed.shape == (seqs + seqs * (2 + 2 * k),)        # ids, then per row logprob, rank, top-k
    ids = packed[:seqs]
    assert ((ids >= 0) & (ids < eng.model_config.vocab_size)).all()


def test_cpu_engine_sizes_as_before(llama_ckpt):
    llm = LLM(llama_ckpt, device="cpu", dtype="float32", block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    eng = llm.engine
    assert eng.memory_profile is None
    assert eng.num_kv_blocks == sizing.CPU_KV_CACHE_BYTES // (eng.kv_cache_bytes // eng.num_kv_blocks)


def test_a_draft_models_sampler_reserves_its_own_penalty_tables(tiny_ckpt):
    cfg = _cfg(tiny_ckpt)
    args = EngineArgs.create(model=tiny_ckpt, gpu_memory_utilization=0.5, max_num_seqs=64)
    p = MemoryProfile(total=8 * GIB, in_use=GIB, activation_peak=0)
    one = blocks_from_budget(args, cfg, CUDA, torch.bfloat16, False, 1, p)
    two = blocks_from_budget(args, cfg, CUDA, torch.bfloat16, False, 1, p, num_samplers=2)
    assert one - two == penalty_table_bytes(64, cfg.vocab_size)


def test_a_draft_models_held_distributions_are_reserved(tiny_ckpt, llama_ckpt):
    """Issue 28 part 5: a draft model's proposal distributions (fp32 [k, V] per request,
    kept from the proposing step to the verifying one) come off the KV budget; n-gram
    proposals keep none."""
    from backend.config import SpeculativeConfig
    cfg = _cfg(tiny_ckpt)
    p = MemoryProfile(total=8 * GIB, in_use=GIB, activation_peak=0)
    plain = EngineArgs.create(model=tiny_ckpt, gpu_memory_utilization=0.5, max_num_seqs=64)
    draft = EngineArgs.create(model=tiny_ckpt, gpu_memory_utilization=0.5, max_num_seqs=64,
                              speculative_config={"method": "draft_model", "model": llama_ckpt,
                                                  "num_speculative_tokens": 3})
    ngram = EngineArgs.create(model=tiny_ckpt, gpu_memory_utilization=0.5, max_num_seqs=64,
                              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    base = blocks_from_budget(plain, cfg, CUDA, torch.bfloat16, False, 1, p)
    assert base - blocks_from_budget(draft, cfg, CUDA, torch.bfloat16, False, 1, p) == 64 * 3 * cfg.vocab_size * 4
    assert blocks_from_budget(ngram, cfg, CUDA, torch.bfloat16, False, 1, p) == base
    assert sizing.draft_probs_bytes(SpeculativeConfig(method="ngram", num_speculative_tokens=2), 8, 10) == 0
    tree = SpeculativeConfig(method="medusa", model="m", speculative_token_tree="[(0,), (1,), (0, 0)]")
    assert sizing.draft_probs_bytes(tree, 8, 10) == 0        # (a tree's acceptance keeps no q)
    # The verify graphs (64 rows x 4 tokens) make the graphs' pool larger than decode's.
    assert _largest(sizing.graph_shapes(ngram)) == 64 * 4 and _largest(sizing.graph_shapes(plain)) == 64
    assert (blocks_from_budget(ngram, cfg, CUDA, torch.bfloat16, True, 1, p)
            < blocks_from_budget(plain, cfg, CUDA, torch.bfloat16, True, 1, p))


def test_a_draft_models_cuda_graphs_are_reserved(tiny_ckpt, llama_ckpt):
    """The draft model captures graphs of its own (its decode ladder and a verify ladder
    of k + 1 tokens a row over its step buffers): their pool, by the draft's shapes, comes
    off the KV budget beside the target's."""
    from backend.engine.runner.cuda_graphs import graph_pool_bytes
    from backend.models.config import load_model_config
    cfg, draft_cfg = _cfg(tiny_ckpt), load_model_config(llama_ckpt)
    p = MemoryProfile(total=8 * GIB, in_use=GIB, activation_peak=0)
    args = EngineArgs.create(model=tiny_ckpt, gpu_memory_utilization=0.5, max_num_seqs=64, enable_lora=True,
                             speculative_config={"method": "draft_model", "model": llama_ckpt,
                                                 "num_speculative_tokens": 3})
    # (With LoRA the target verifies eagerly; the draft has no LoRA and keeps its verify ladder.)
    shapes = sizing.draft_graph_shapes(args)
    assert _largest(sizing.graph_shapes(args)) == 64 and _largest(shapes) == 64 * 4
    assert {s.query_len for s in shapes} == {1, 4}
    without = blocks_from_budget(args, cfg, CUDA, torch.bfloat16, True, 1, p)
    with_draft = blocks_from_budget(args, cfg, CUDA, torch.bfloat16, True, 1, p, draft_cfg=draft_cfg)
    assert without - with_draft == graph_pool_bytes(draft_cfg, shapes, 2)
    assert blocks_from_budget(args, cfg, CUDA, torch.bfloat16, False, 1, p, draft_cfg=draft_cfg) == \
        blocks_from_budget(args, cfg, CUDA, torch.bfloat16, False, 1, p)     # no graphs, nothing reserved


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_profile_step_verifies_at_max_num_seqs_times_k_plus_one_rows(llama_ckpt, method):
    """With speculation the profile's sampler is a verify step: max_num_seqs requests, k
    proposals each, every row through the rejection sampler (run here on the CPU)."""
    seqs, k = 4, 2
    spec = {"method": method, "num_speculative_tokens": k, **({"model": llama_ckpt} if method == "draft_model" else {})}
    llm = LLM(llama_ckpt, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, max_num_seqs=seqs,
              max_num_batched_tokens=16, speculative_config=spec)
    eng = llm.engine
    packed = prefill_step(eng.model, eng.args, torch.float32, eng.device, eng.model_config.vocab_size)()()
    rows = seqs * (k + 1)
    m = eng.args.max_logprobs
    assert packed.shape == (rows + rows * (2 + 2 * m) + rows,)    # ids, logprobs, then accept flags
    flags = packed[-rows:].view(seqs, k + 1)
    assert ((flags == 0) | (flags == 1)).all() and (flags[:, k] == 0).all()   # a bonus row proposes nothing
    mem = FakeMemory(total=1 << 40, other=0)
    assert measure(mem, prefill_step(eng.model, eng.args, torch.float32, eng.device,
                                     eng.model_config.vocab_size)).activation_peak == 0


def test_estimated_profile_where_no_step_can_run_alone(tiny_ckpt):
    from backend.engine.runner.cuda_graphs import estimate_graph_bytes
    from backend.engine.runner.profile_run import estimated_profile
    cfg = _cfg(tiny_ckpt)
    args = EngineArgs.create(model=tiny_ckpt, max_num_batched_tokens=256, max_num_seqs=32)
    mem = FakeMemory(total=1000 * GIB, other=3 * GIB)
    p = estimated_profile(cfg, args, 2, CUDA, memory=mem)
    assert not p.profiled and p.in_use == 3 * GIB
    assert p.activation_peak == estimate_graph_bytes(cfg, 256, 2)
    with pytest.raises(ConfigError, match=r"peak activation memory \(estimated\)"):
        cuda_kv_budget(MemoryProfile(p.total, 999 * GIB, p.activation_peak, profiled=False), 0.9)


def test_engine_profiles_with_its_own_model(llama_ckpt, monkeypatch):
    """The engine's CUDA branch (assembly.measure_memory), driven on the CPU with a fake
    device: it runs the profile step on its loaded model and returns the fake's figures."""
    from backend.engine.runner import profile_run
    from backend.engine.assembly import measure_memory
    llm = LLM(llama_ckpt, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=16)
    mem = FakeMemory(total=64 * GIB, other=2 * GIB)
    monkeypatch.setattr(profile_run, "CudaMemory", lambda device: mem)
    e = llm.engine
    p = measure_memory(e.model, None, e.model_config, e.args, e.dtype, torch.float32, e.device)
    assert p.profiled and p.total == 64 * GIB and p.in_use == 2 * GIB
    assert mem.calls.count("reset_peak") == 1


def test_startup_snapshot_is_the_driver_figures_after_a_release():
    from backend.engine.runner.profile_run import startup_snapshot
    mem = FakeMemory(total=64 * GIB, other=5 * GIB)
    assert startup_snapshot(CUDA, mem) == (59 * GIB, 64 * GIB) and mem.calls == ["release"]


def test_profile_step_verifies_a_tree(llama_ckpt, tmp_path):
    """With a tree of proposals the profile's verify step has a row per node and the root,
    planned as a tree (no draft distributions), run here on the CPU."""
    from builder.medusa_heads import random_heads
    heads = random_heads(llama_ckpt, str(tmp_path / "medusa"), num_heads=2, num_layers=1, seed=1)
    seqs, nodes = 4, 3
    llm = LLM(llama_ckpt, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, max_num_seqs=seqs,
              max_num_batched_tokens=16,
              speculative_config={"method": "medusa", "model": heads, "speculative_token_tree": "[(0,), (1,), (0, 0)]"})
    eng = llm.engine
    packed = prefill_step(eng.model, eng.args, torch.float32, eng.device, eng.model_config.vocab_size)()()
    rows = seqs * (nodes + 1)
    m = eng.args.max_logprobs
    assert packed.shape == (rows + rows * (2 + 2 * m) + rows,)
    flags = packed[-rows:].view(seqs, nodes + 1)
    assert ((flags == 0) | (flags == 1)).all() and (flags[:, 0] == 0).all()     # a root proposes nothing
