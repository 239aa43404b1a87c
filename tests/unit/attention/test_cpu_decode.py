"""The CPU decode-attention kernel (backend/attention/cpu_decode.py): the same outputs as
the from-the-definition reference and the torch path it replaces, for GQA, windows,
bf16 and more than one thread; built once and cached; the torch path where it cannot
be built or is switched off."""

import os

import pytest
import torch

from backend.attention import cpu_decode
from backend.attention.torch_attention import TorchPagedAttention
from tests.helpers.paged_batch import build, rel_err
from tests.unit.attention.test_torch_attention import _dense_reference

# Decode rows (new length 1) of lengths 1 to 70 around two prefill chunks, which the
# kernel must leave to the torch path.
SEQS = [(13, 1), (0, 9), (40, 1), (10, 5), (3, 1), (0, 1), (69, 1), (25, 1)]


@pytest.fixture
def lib():
    lib = cpu_decode.kernel()
    assert lib is not None, "the CPU test machine has g++: the kernel must build"
    return lib


def _forward(q, k, v, cache, meta, window=None, heads=(4, 2), head_dim=16):
    return TorchPagedAttention(heads[0], heads[1], head_dim, 0.25, window).forward(q, k, v, cache, meta)


@pytest.mark.parametrize("group,window", [(2, None), (1, None), (4, 6), (2, 1)])
def test_kernel_follows_the_definition(lib, group, window):
    q, k, v, cache, meta = build(SEQS, 4, 2, group, 16, seed=5)
    calls = []
    real = cpu_decode.paged_decode

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    cpu_decode.paged_decode = counted
    try:
        out = TorchPagedAttention(2 * group, 2, 16, 0.25, window).forward(q, k, v, cache, meta)
    finally:
        cpu_decode.paged_decode = real
    assert calls == [1]                         # one call for all the step's decode rows
    ref = _dense_reference(q, k, v, cache, meta, 0.25, window, None)
    assert rel_err(out, ref) < 1e-5


def test_kernel_equals_the_torch_path_and_reads_the_cache_in_place(lib, monkeypatch):
    q, k, v, cache, meta = build(SEQS, 16, 2, 2, 32, seed=7)
    key, value = cache.key.clone(), cache.value.clone()
    out = _forward(q, k, v, cache, meta, head_dim=32)
    cache.key.copy_(key)
    cache.value.copy_(value)
    monkeypatch.setenv(cpu_decode.ENV_SWITCH, "0")
    assert cpu_decode.kernel() is None
    torch_path = _forward(q, k, v, cache, meta, head_dim=32)
    assert (out - torch_path).abs().max() < 1e-5
    # A decode row's output moves with the key it reads: the kernel reads the pool itself.
    row, seq = 0, 0
    block = meta.block_tables[seq, 0]
    cache.key[block, 0] += 3.0
    monkeypatch.delenv(cpu_decode.ENV_SWITCH)
    again = _forward(q, k, v, cache, meta, head_dim=32)
    assert (again[row] - out[row]).abs().max() > 1e-3
    assert torch.equal(again[1:10], out[1:10])        # the prefill chunk's rows: another sequence


def test_bf16_and_threads(lib):
    q, k, v, cache, meta = build(SEQS * 3, 4, 2, 2, 16, seed=11)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(_forward(q, k, v, cache, meta))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])   # threads split the work, not the sums
    ref = _dense_reference(q, k, v, cache, meta, 0.25, None, None)     # (the forward wrote k, v)
    assert rel_err(outs[0], ref) < 1e-5
    cache16 = type(cache)(cache.key.bfloat16(), cache.value.bfloat16())
    q16, k16, v16 = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out16 = _forward(q16, k16, v16, cache16, meta)
    assert out16.dtype == torch.bfloat16
    ref16 = _dense_reference(q16.float(), k16.float(), v16.float(),
                             type(cache)(cache16.key.float(), cache16.value.float()), meta, 0.25, None, None)
    assert rel_err(out16, ref16) < 1e-2


def test_built_once_and_cached(lib, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_LLM_CACHE_DIR", str(tmp_path))
    first = cpu_decode._build("g++")
    mtime = os.stat(first).st_mtime_ns
    assert cpu_decode._build("g++") == first and os.stat(first).st_mtime_ns == mtime
    assert os.listdir(tmp_path) == [os.path.basename(first)]          # no temporary file left


def test_no_compiler_means_the_torch_path(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PAGED_LLM_CACHE_DIR", str(tmp_path))
    with caplog.at_level("WARNING"):
        assert cpu_decode.kernel() is None
    assert "torch path" in caplog.text
    q, k, v, cache, meta = build(SEQS, 4, 2, 2, 16, seed=5)
    out = _forward(q, k, v, cache, meta)
    assert rel_err(out, _dense_reference(q, k, v, cache, meta, 0.25, None, None)) < 1e-5


def test_soft_cap_sinks_and_quantized_caches_stay_on_the_torch_path():
    q, k, v, cache, meta = build(SEQS, 4, 2, 2, 16, seed=5)
    assert cpu_decode.supports(q, cache.key, None, None)
    assert not cpu_decode.supports(q, cache.key, 30.0, None)
    assert not cpu_decode.supports(q, cache.key, None, torch.zeros(4))
    assert not cpu_decode.supports(q, cache.key.to(torch.float8_e4m3fn), None, None)
    assert not cpu_decode.supports(q, cache.key.to(torch.int8), None, None)


def test_unwritable_cache_folder_falls_back_to_the_temporary_folder(tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("PAGED_LLM_CACHE_DIR", str(blocked / "cache"))    # cannot be made
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)                       # re-read TMPDIR
    assert cpu_decode._cache_dir().startswith(str(tmp_path / "paged_llm-"))
    assert os.path.dirname(cpu_decode._build("g++")) == cpu_decode._cache_dir()
