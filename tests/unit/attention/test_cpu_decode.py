"""The CPU decode-attention kernel (backend/attention/cpu_decode.py): the same outputs as
the from-the-definition reference and the torch path it replaces, for GQA, windows,
bf16, the engine's strided layouts and more than one thread; the torch path where it
cannot be built, is switched off, or does not apply (building: tests/unit/ops/test_cpu_build.py)."""

import platform
from unittest import mock
import threading

import pytest
import torch

from backend.attention import cpu_decode
from backend.attention.metadata import AttentionMetadata, KVCacheLayer
from backend.attention.torch_attention import TorchPagedAttention
from tests.helpers.paged_batch import build, rel_err
from tests.unit.attention.test_torch_attention import _dense_reference

# Decode rows (new length 1) of lengths 1 to 70 around two prefill chunks (one after a
# cached context), whose tokens the kernel takes as rows of their own.
SEQS = [(13, 1), (0, 9), (40, 1), (10, 5), (3, 1), (0, 1), (69, 1), (25, 1)]


@pytest.fixture
def kernel_calls(monkeypatch):
    """The kernel's calls, counted: each test shows the kernel ran, not the torch path."""
    assert cpu_decode.kernel() is not None, "the CPU test machine has g++: the kernel must build"
    calls = []
    real = cpu_decode.paged_decode

    def counted(*args, **kwargs):
        calls.append(args[4].num_rows)
        return real(*args, **kwargs)
    monkeypatch.setattr(cpu_decode, "paged_decode", counted)
    return calls


def _forward(q, k, v, cache, meta, window=None, heads=(4, 2), head_dim=16):
    return TorchPagedAttention(heads[0], heads[1], head_dim, 0.25, window).forward(q, k, v, cache, meta)


@pytest.mark.parametrize("group,window,head_dim", [(2, None, 16), (1, None, 16), (4, 6, 16), (2, 1, 16),
                                                   (2, 5, 12), (2, None, 64), (1, 5, 128), (4, None, 32),
                                                   (2, 11, 256)])
def test_kernel_follows_the_definition(kernel_calls, group, window, head_dim):
    """GQA, MHA, windows (one key; mid-block starts), a head size the four-key path does
    not take (12), and the head sizes compiled for (32-256: fp32 in x86 vector tiles where
    the CPU has AVX2 or AVX-512), whose eight-key groups meet block ends and windows."""
    # Eight-key groups need blocks of eight or more: 16 (two groups), 8 (one) at D 128.
    block_size = 4 if head_dim < 32 else 8 if head_dim == 128 else 16
    q, k, v, cache, meta = build(SEQS, block_size, 2, group, head_dim, seed=5)
    out = TorchPagedAttention(2 * group, 2, head_dim, 0.25, window).forward(q, k, v, cache, meta)
    assert kernel_calls == [6 + 9 + 5]          # one call: six decode rows, two short prompts' tokens
    ref = _dense_reference(q, k, v, cache, meta, 0.25, window, None)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("window", [None, 4])
def test_prompts_past_the_kernels_limit_stay_on_sdpa(kernel_calls, monkeypatch, window):
    """A prompt chunk whose sequence has more than PREFILL_MAX_KEYS keys (here the one
    after a cached context: 15 keys) runs SDPA, the others the kernel, in one step."""
    monkeypatch.setattr(cpu_decode, "PREFILL_MAX_KEYS", 12)
    q, k, v, cache, meta = build(SEQS, 4, 2, 2, 16, seed=21)
    prefills = []
    real = TorchPagedAttention._prefill
    monkeypatch.setattr(TorchPagedAttention, "_prefill", lambda self, q, *a: prefills.append(q.shape[0]) or real(self, q, *a))
    out = TorchPagedAttention(4, 2, 16, 0.25, window).forward(q, k, v, cache, meta)
    assert kernel_calls == [6 + 9] and prefills == [5]
    assert rel_err(out, _dense_reference(q, k, v, cache, meta, 0.25, window, None)) < 1e-5


def test_the_fp32_tiles_are_built_where_the_cpu_has_avx2():
    """The x86 vector tiles (cpu_attn_tiles.h) are what the tests above check on a CPU with
    AVX2 and FMA (the CI machines: AVX-512), at the head sizes compiled for; elsewhere
    the generic loops are."""
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    expected = platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma"} <= flags
    lib = cpu_decode.kernel()
    assert [lib.f32_tiles(d) for d in (32, 64, 128, 256)] == [int(expected)] * 4
    assert [lib.f32_tiles(d) for d in (12, 16, 80, 96)] == [0] * 4


def test_the_engines_layouts(kernel_calls):
    """q a view of a wider qkv row (the model's one GEMM output), block tables a slice of
    a wider, taller table (persistent tables, shard_meta's rows), out of every row."""
    q, k, v, cache, meta = build(SEQS, 4, 2, 2, 16, seed=9)
    T, H, D = q.shape
    qkv = torch.randn(T, H * D + 64)
    qkv[:, :H * D] = q.reshape(T, -1)
    q_view = qkv[:, :H * D].view(T, H, D)
    assert not q_view.is_contiguous()
    wide = torch.full((len(SEQS) + 3, meta.block_tables.shape[1] + 5), -1, dtype=torch.int32)
    wide[2:2 + len(SEQS), :meta.block_tables.shape[1]] = meta.block_tables
    strided = AttentionMetadata(meta.query_start_loc, meta.seq_lens, wide[2:2 + len(SEQS)], meta.slot_mapping,
                                meta.query_lens_cpu, meta.seq_lens_cpu, meta.max_query_len, meta.max_seq_len)
    out = _forward(q_view, k, v, cache, strided)
    assert kernel_calls == [6 + 9 + 5]
    assert rel_err(out, _dense_reference(q, k, v, cache, meta, 0.25, None, None)) < 1e-5


def test_kernel_equals_the_torch_path_and_reads_the_cache_in_place(kernel_calls, monkeypatch):
    q, k, v, cache, meta = build(SEQS, 16, 2, 2, 32, seed=7)
    out = _forward(q, k, v, cache, meta, head_dim=32)
    assert len(kernel_calls) == 1
    monkeypatch.setenv(cpu_decode.ENV_SWITCH, "0")
    assert cpu_decode.kernel() is None
    torch_path = _forward(q, k, v, cache, meta, head_dim=32)
    assert len(kernel_calls) == 1 and (out - torch_path).abs().max() < 1e-5
    # A decode row's output moves with the key it reads: the kernel reads the pool itself.
    cache.key[meta.block_tables[0, 0], 0] += 3.0
    monkeypatch.delenv(cpu_decode.ENV_SWITCH)
    again = _forward(q, k, v, cache, meta, head_dim=32)
    assert len(kernel_calls) == 2
    assert (again[0] - out[0]).abs().max() > 1e-3
    assert torch.equal(again[1:10], out[1:10])        # the prefill chunk's rows: another sequence


def test_threads_split_the_work_not_the_sums(kernel_calls):
    # Long enough for more than one thread (each takes at least 2,048 keys); two prompts'
    # rows among them (one after a cached context), at a head size of the fp32 tiles.
    q, k, v, cache, meta = build([(300 + 13 * i, 1) for i in range(24)] + [(0, 200), (100, 60)], 16, 2, 2, 64,
                                 seed=11)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(_forward(q, k, v, cache, meta, head_dim=64))
    finally:
        torch.set_num_threads(before)
    assert kernel_calls == [24 + 200 + 60] * 3
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert rel_err(outs[0], _dense_reference(q, k, v, cache, meta, 0.25, None, None)) < 1e-5


def test_concurrent_calls_on_disjoint_sequences(kernel_calls):
    """The forward's shard threads (cpu_shards.py) call the kernel at once."""
    q, k, v, cache, meta = build(SEQS, 4, 2, 2, 16, seed=13)
    alone = _forward(q, k, v, cache, meta)
    results = {}

    def run(name):
        for _ in range(20):
            meta.decode_plan = None
            results[name] = _forward(q, k, v, cache, meta)
    threads = [threading.Thread(target=run, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(kernel_calls) == 41
    assert torch.equal(results[0], alone) and torch.equal(results[1], alone)


def test_bf16_rounds_the_fp32_result(kernel_calls):
    """bf16 q/K/V: fp32 inside, one round to nearest even at the end, bit for bit what the
    kernel gives in fp32 on the same values, rounded."""
    q, k, v, cache, meta = build(SEQS, 4, 2, 2, 16, seed=11)
    cache16 = KVCacheLayer(cache.key.bfloat16(), cache.value.bfloat16())
    q16, k16, v16 = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out16 = _forward(q16, k16, v16, cache16, meta)
    out32 = _forward(q16.float(), k16.float(), v16.float(),
                     KVCacheLayer(cache16.key.float(), cache16.value.float()), meta)
    assert kernel_calls == [6 + 9 + 5] * 2 and out16.dtype == torch.bfloat16
    assert torch.equal(out16, out32.bfloat16())       # every row: decode rows and prompts' tokens


def test_no_compiler_means_the_torch_path(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PAGED_LLM_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(cpu_decode, "paged_decode", lambda *a, **k: calls.append(1))
    with caplog.at_level("WARNING"):
        assert cpu_decode.kernel() is None
    assert "torch path" in caplog.text
    q, k, v, cache, meta = build(SEQS, 4, 2, 2, 16, seed=5)
    out = _forward(q, k, v, cache, meta)
    assert not calls
    assert rel_err(out, _dense_reference(q, k, v, cache, meta, 0.25, None, None)) < 1e-5


def test_soft_cap_sinks_and_quantized_caches_stay_on_the_torch_path():
    q, k, v, cache, meta = build(SEQS, 4, 2, 2, 16, seed=5)
    key, value = cache.key, cache.value
    assert cpu_decode.supports(q, key, value, None, None)
    assert not cpu_decode.supports(q, key, value, 30.0, None)
    assert not cpu_decode.supports(q, key, value, None, torch.zeros(4))
    assert not cpu_decode.supports(q, key.to(torch.float8_e4m3fn), value, None, None)
    assert not cpu_decode.supports(q, key.to(torch.int8), value.to(torch.int8), None, None)
    assert not cpu_decode.supports(q, key, value.to(torch.bfloat16), None, None)
    assert not cpu_decode.supports(q, key, value.transpose(1, 2), None, None)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_equals_the_torch_writer(slot_dtype):
    """K/V rows from views of one GEMM's rows (v is), int32 or int64 slots, into the pool:
    the same bytes as torch_attention.write_kv; a slot past the pool is an error."""
    from backend.attention.torch_attention import write_kv as torch_write_kv
    lib = cpu_decode.kernel()
    g = torch.Generator().manual_seed(3)
    T, KVH, D, blocks, bs = 7, 2, 8, 6, 4
    kv = torch.randn(T, 2 * KVH * D + 5, generator=g)
    k, v = kv[:, :KVH * D].view(T, KVH, D), kv[:, KVH * D:2 * KVH * D].view(T, KVH, D)
    slots = torch.randperm(blocks * bs, generator=g)[:T].to(slot_dtype)
    ours = KVCacheLayer(torch.zeros(blocks, bs, KVH, D), torch.zeros(blocks, bs, KVH, D))
    ref = KVCacheLayer(torch.zeros(blocks, bs, KVH, D), torch.zeros(blocks, bs, KVH, D))
    assert cpu_decode.write_kv(lib, k, v, ours.key, ours.value, slots)
    torch_write_kv(k, v, ref, slots)
    assert torch.equal(ours.key, ref.key) and torch.equal(ours.value, ref.value)
    with pytest.raises(IndexError):
        cpu_decode.write_kv(lib, k[:1], v[:1], ours.key, ours.value, torch.tensor([blocks * bs], dtype=slot_dtype))
    assert not cpu_decode.write_kv(lib, k.bfloat16(), v.bfloat16(), ours.key, ours.value, slots)   # left to torch


def test_the_forward_writes_through_the_kernel(kernel_calls, monkeypatch):
    writes = []
    real = cpu_decode.write_kv
    monkeypatch.setattr(cpu_decode, "write_kv", lambda *a: writes.append(1) or real(*a))
    q, k, v, cache, meta = build(SEQS, 4, 2, 2, 16, seed=21)
    out = _forward(q, k, v, cache, meta)
    assert writes == [1] and len(kernel_calls) == 1
    assert rel_err(out, _dense_reference(q, k, v, cache, meta, 0.25, None, None)) < 1e-5


def test_a_bad_block_table_is_an_error_not_a_stray_read(kernel_calls):
    q, k, v, cache, meta = build(SEQS, 4, 2, 2, 16, seed=23)
    bad = meta.block_tables.clone()
    bad[2, 0] = cache.key.shape[0] + 1000                   # a block past the pool
    meta.block_tables = bad
    with pytest.raises(RuntimeError, match="outside the pool"):
        _forward(q, k, v, cache, meta)
    q, k, v, cache, meta = build(SEQS, 4, 2, 2, 16, seed=23)
    meta.seq_lens_cpu = [n + 4 * meta.block_tables.shape[1] if i == 2 else n
                         for i, n in enumerate(meta.seq_lens_cpu)]   # longer than its table
    with pytest.raises(RuntimeError, match="shorter than its length"):
        _forward(q, k, v, cache, meta)


def test_tree_rows_see_their_ancestors_only(kernel_calls):
    """A tree of proposals (AttentionMetadata.tree) through the kernel's rows: a
    verification (root and four nodes) and a drafter's level (two nodes of a tree whose
    first level is cached) beside a plain decode row, against the explicit mask."""
    from backend.engine.spec_decode.token_tree import TokenTree
    bits = TokenTree.parse("[(0,), (1,), (0, 0), (1, 0)]").bits.tolist()
    seqs = [(20, 5), (17, 2), (30, 1)]
    none = [2 ** 40, 0]
    q, k, v, cache, meta = build(seqs, 4, 2, 2, 16, seed=23)
    meta.tree = torch.tensor([none] + [[21, b] for b in bits] + [[15, bits[2]], [15, bits[3]]] + [none])
    out = TorchPagedAttention(4, 2, 16, 0.25).forward(q, k, v, cache, meta)
    assert kernel_calls == [8]
    no_kernel = build(seqs, 4, 2, 2, 16, seed=23)
    no_kernel[4].tree = meta.tree
    with mock.patch.object(cpu_decode, "kernel", lambda: None):
        ref = TorchPagedAttention(4, 2, 16, 0.25).forward(*no_kernel)
    assert rel_err(out, ref) < 1e-5
    causal = TorchPagedAttention(4, 2, 16, 0.25).forward(*build(seqs, 4, 2, 2, 16, seed=23))
    assert rel_err(out[2:5], causal[2:5]) > 1e-2 and rel_err(out[:2], causal[:2]) < 1e-6
