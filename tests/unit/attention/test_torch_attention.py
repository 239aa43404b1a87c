"""The torch path's paged-block gather: the same values into a buffer reused from call to
call (fresh CPU tensors of this size are page-faulted in on every step)."""

import pytest
import torch

from backend.attention.torch_attention import _gather


def test_gather_into_reused_buffer_equals_fresh_gather():
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(40, 4, 2, 8, generator=g)
    tables = torch.randint(0, 40, (3, 5), generator=g)
    fresh = _gather(cache, tables, 1.0, torch.float32)
    reused = _gather(cache, tables, 1.0, torch.float32, slot=0)
    assert fresh.shape == reused.shape == (3, 20, 2, 8)
    assert torch.equal(fresh, reused) and torch.equal(fresh[1, 4:8], cache[tables[1, 1]])
    again = _gather(cache, tables[:2], 1.0, torch.float32, slot=0)     # a smaller batch: same buffer
    assert again.data_ptr() == reused.data_ptr() and torch.equal(again, fresh[:2])


def test_buffer_made_during_inference_serves_calls_outside_it():
    """An engine step (inference_mode) may create the buffer; exports and direct model
    calls then gather outside inference_mode into the same buffer."""
    import threading
    result = {}

    def run():   # a fresh thread: a fresh workspace, first made inside inference_mode
        cache = torch.randn(30, 4, 2, 8)
        tables = torch.randint(0, 30, (2, 3))
        with torch.inference_mode():
            _gather(cache, tables, 1.0, torch.float32, slot=0)
        result["out"] = _gather(cache, tables, 1.0, torch.float32, slot=0).clone()
        result["ref"] = _gather(cache, tables, 1.0, torch.float32)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert torch.equal(result["out"], result["ref"])


def _dense_reference(q, k, v, cache, meta, scale, window, cap):
    """Each query over its sequence's keys, one head at a time, straight from the
    definition (fp64): keys read back through the block table, window and cap applied."""
    import math
    out = torch.zeros_like(q, dtype=torch.float64)
    bs = cache.block_size
    group = q.shape[1] // cache.key.shape[2]
    qsl = meta.query_start_loc.tolist()
    for s, seq_len in enumerate(meta.seq_lens_cpu):
        table = meta.block_tables[s].tolist()
        keys = torch.stack([cache.key[table[p // bs], p % bs] for p in range(seq_len)]).double()
        vals = torch.stack([cache.value[table[p // bs], p % bs] for p in range(seq_len)]).double()
        for t in range(qsl[s], qsl[s + 1]):
            pos = seq_len - (qsl[s + 1] - t)
            for h in range(q.shape[1]):
                logits = []
                for j in range(pos + 1):
                    if window is not None and j <= pos - window:
                        continue
                    x = float(q[t, h].double() @ keys[j, h // group]) * scale
                    logits.append((j, cap * math.tanh(x / cap) if cap else x))
                m = max(x for _, x in logits)
                w = [(j, math.exp(x - m)) for j, x in logits]
                z = sum(e for _, e in w)
                out[t, h] = sum(e / z * vals[j, h // group] for j, e in w)
    return out


@pytest.mark.parametrize("cpu_kernel", ["1", "0"])
def test_window_and_soft_cap_follow_the_definition(cpu_kernel, monkeypatch):
    """Sliding window (keys more than window - 1 positions back masked) and soft-cap
    (cap * tanh(score / cap) before the softmax) in decode, prefill and a chunk after a
    cached context, GQA, against a from-the-definition reference; the decode rows through
    the CPU kernel (cpu_decode.py) and through the torch path it replaces."""
    monkeypatch.setenv("PAGED_LLM_CPU_DECODE_KERNEL", cpu_kernel)
    from backend.attention.torch_attention import TorchPagedAttention
    from tests.helpers.paged_batch import build, rel_err
    seqs = [(13, 1), (0, 9), (10, 5), (3, 1)]
    for window, cap in [(4, None), (None, 0.6), (5, 0.6)]:
        q, k, v, cache, meta = build(seqs, 4, 2, 2, 16, seed=3)
        out = TorchPagedAttention(4, 2, 16, 0.25, window, cap).forward(q, k, v, cache, meta)
        ref = _dense_reference(q, k, v, cache, meta, 0.25, window, cap)
        assert rel_err(out, ref) < 1e-5, (window, cap)
        plain = _dense_reference(q, k, v, cache, meta, 0.25, None, None)
        assert rel_err(plain, ref) > 1e-2       # the case exercises what it names


@pytest.mark.parametrize("kernel_max_keys", [0, 512], ids=["sdpa", "cpu-kernel"])
def test_prefill_without_window_or_cap_follows_the_definition(monkeypatch, kernel_max_keys):
    """The prefill paths a plain layer takes: a whole sequence in one chunk (SDPA's own
    causal mask) and a chunk after a cached context (an explicit mask), GQA, beside decode
    rows; against the from-the-definition reference. On SDPA, and on CPU's C++ kernel
    (cpu_decode.py: short prompts' tokens as rows of their own)."""
    from backend.attention import cpu_decode
    from backend.attention.torch_attention import TorchPagedAttention
    monkeypatch.setattr(cpu_decode, "PREFILL_MAX_KEYS", kernel_max_keys)
    from tests.helpers.paged_batch import build, rel_err
    q, k, v, cache, meta = build([(0, 9), (10, 5), (3, 1), (0, 33)], 4, 2, 2, 16, seed=5)
    out = TorchPagedAttention(4, 2, 16, 0.25).forward(q, k, v, cache, meta)
    assert rel_err(out, _dense_reference(q, k, v, cache, meta, 0.25, None, None)) < 1e-5


def test_prefill_runs_sdpa_fused_cpu_kernel(monkeypatch):
    """4-D inputs: SDPA's fused CPU kernel, not its math path (3-D inputs fell back to the
    math path, 1.7-3x slower), for a whole-sequence chunk and a chunk after context (of
    sequences past what the C++ kernel takes: cpu_decode.PREFILL_MAX_KEYS)."""
    from backend.attention import cpu_decode
    from backend.attention.torch_attention import TorchPagedAttention
    monkeypatch.setattr(cpu_decode, "PREFILL_MAX_KEYS", 0)
    from tests.helpers.paged_batch import build
    for seqs in ([(0, 24)], [(16, 8)]):
        q, k, v, cache, meta = build(seqs, 4, 2, 2, 16, seed=1)
        with torch.profiler.profile() as prof:
            TorchPagedAttention(4, 2, 16, 0.25).forward(q, k, v, cache, meta)
        names = {e.key for e in prof.key_averages()}
        assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names, seqs
        assert "aten::_scaled_dot_product_attention_math" not in names, seqs
