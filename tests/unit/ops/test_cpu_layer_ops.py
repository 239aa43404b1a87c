"""The C++ layer ops on the CPU (backend/ops/cpu_layer_ops.py): what the torch references
compute (rotary and the residual add bit for bit, RMSNorm within the last bit of its
mean), on the engine's layouts; the references wherever they do not apply."""

import pytest
import torch

from backend.ops import cpu_layer_ops, make_layer_ops, reference


@pytest.fixture
def calls(monkeypatch):
    """The C++ functions' calls, by name: each test shows which path ran."""
    lib = cpu_layer_ops.library()
    assert lib is not None, "the CPU test machine has g++: the library must build"
    seen = []

    class Counting:
        def __getattr__(self, name):
            fn = getattr(lib, name)

            def call(*args):
                seen.append(name)
                return fn(*args)
            return call
    monkeypatch.setattr(cpu_layer_ops, "library", lambda: Counting())
    return seen


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_make_layer_ops_torch_takes_them():
    ops = make_layer_ops("torch")
    assert ops.add_rms_norm is cpu_layer_ops.add_rms_norm and ops.rotary is cpu_layer_ops.rotary


def test_add_rms_norm_matches_the_reference(calls):
    g = _gen()
    rows = torch.randn(33, 256 + 40, generator=g)
    x = rows[:, :256]                       # a view of wider rows, as a GEMM slice may be
    residual, weight = torch.randn(33, 256, generator=g), torch.randn(256, generator=g)
    out, res = cpu_layer_ops.add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_res = reference.add_rms_norm(x, residual, weight, 1e-6)
    assert calls == ["add_rms_norm_f32"]
    assert torch.equal(res, ref_res)
    assert ((out - ref_out).abs() / ref_out.abs().clamp_min(1e-3)).max() < 1e-6
    out, same = cpu_layer_ops.add_rms_norm(x, None, weight, 1e-6)
    assert same is x and ((out - reference.rms_norm(x, weight, 1e-6)).abs()).max() < 1e-5
    assert len(calls) == 2


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_rotary_is_bit_identical_to_the_reference(calls, dtype):
    g = _gen(1)
    T, H, KVH, D = 19, 8, 4, 32
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g)       # q and k: views of one GEMM's rows
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)
    positions = torch.randint(0, 100, (T,), generator=g, dtype=dtype)
    cos, sin = torch.randn(100, D, generator=g), torch.randn(100, D, generator=g)
    q_out, k_out = cpu_layer_ops.rotary(positions, q, k, cos, sin)
    q_ref, k_ref = reference.rotary(positions.long(), q, k, cos, sin)
    assert calls == ["rotary_f32"]
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    with pytest.raises(IndexError):
        cpu_layer_ops.rotary(torch.tensor([3, 100], dtype=dtype), q[:2], k[:2], cos, sin)


def test_the_references_run_where_the_ops_do_not_apply(calls, monkeypatch):
    g = _gen(2)
    x, weight = torch.randn(5, 64, generator=g), torch.randn(64, generator=g)
    q, k = torch.randn(5, 4, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    positions = torch.arange(5)
    cos, sin = torch.randn(10, 16, generator=g), torch.randn(10, 16, generator=g)
    # bf16 activations; Qwen3's q/k norms; partial rotary (tables narrower than D).
    out, _ = cpu_layer_ops.add_rms_norm(x.bfloat16(), None, weight.bfloat16(), 1e-6)
    assert torch.equal(out, reference.rms_norm(x.bfloat16(), weight.bfloat16(), 1e-6))
    norm_w = torch.randn(16, generator=g)
    got = cpu_layer_ops.rotary(positions, q, k, cos, sin, norm_w, norm_w, 1e-6)
    want = reference.rotary(positions, q, k, cos, sin, norm_w, norm_w, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    got = cpu_layer_ops.rotary(positions, q, k, cos[:, :8], sin[:, :8])
    assert all(torch.equal(a, b) for a, b in zip(got, reference.rotary(positions, q, k, cos[:, :8], sin[:, :8])))
    # Traced calls (fake tensors have no memory to hand over).
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fake_out, _ = cpu_layer_ops.add_rms_norm(torch.empty(5, 64), None, torch.empty(64), 1e-6)
    assert fake_out.shape == (5, 64)
    assert calls == []
    monkeypatch.setenv(cpu_layer_ops.ENV_SWITCH, "0")
    monkeypatch.setattr(cpu_layer_ops, "library", cpu_layer_ops._LIBRARY.get)
    assert cpu_layer_ops.library() is None
    out, _ = cpu_layer_ops.add_rms_norm(x, None, weight, 1e-6)
    assert torch.equal(out, reference.rms_norm(x, weight, 1e-6))


def test_bad_shapes_and_devices_take_the_reference_not_memory(calls):
    """Positions not one per token, a weight or table off the CPU, no tokens: what the
    reference does (its error, or its empty result), never a read past a buffer."""
    g = _gen(4)
    q, k = torch.randn(4, 2, 8, generator=g), torch.randn(4, 1, 8, generator=g)
    cos, sin = torch.randn(10, 8, generator=g), torch.randn(10, 8, generator=g)
    with pytest.raises(RuntimeError):
        cpu_layer_ops.rotary(torch.tensor([1, 2]), q, k, cos, sin)       # 2 positions for 4 tokens
    x = torch.randn(3, 8, generator=g)
    with pytest.raises((RuntimeError, NotImplementedError)):
        cpu_layer_ops.add_rms_norm(x, None, torch.ones(8, device="meta"), 1e-6)
    with pytest.raises((RuntimeError, NotImplementedError)):
        cpu_layer_ops.rotary(torch.arange(4), q, k, cos.to("meta"), sin.to("meta"))
    assert calls == []
    empty_q, empty_k = cpu_layer_ops.rotary(torch.arange(0), q[:0], k[:0], cos, sin)
    out, res = cpu_layer_ops.add_rms_norm(x[:0], x[:0], torch.ones(8), 1e-6)
    assert empty_q.shape == (0, 2, 8) and empty_k.shape == (0, 1, 8) and out.shape == res.shape == (0, 8)


@pytest.mark.parametrize("T,I,strided", [(3, 40, False), (7, 33, True), (300, 1000, False)],
                         ids=["small", "odd-width-strided-rows", "threaded"])
def test_silu_and_mul_matches_the_reference(calls, T, I, strided):
    """One pass over [gate | up]; our exp (cpu_vec.h) differs from torch's in the last
    bits (4 ulp at most seen; 98% of values equal). 300 x 1000 is split over the threads,
    and its rows over two of the kernel's 512-wide chunks (one whole, one partial)."""
    g = _gen(3)
    wide = torch.randn(T, 2 * I + (5 if strided else 0), generator=g) * 4
    x = wide[:, :2 * I]
    assert x.is_contiguous() is not strided
    out = cpu_layer_ops.act_and_mul(x, "silu")
    want = reference.act_and_mul(x, "silu")
    assert calls == ["silu_and_mul_f32"] and out.shape == (T, I) and out.is_contiguous()
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    assert make_layer_ops("torch").act_and_mul is cpu_layer_ops.act_and_mul


def test_silu_and_mul_leaves_other_cases_to_the_reference(calls):
    x = torch.randn(4, 16, generator=_gen())
    for args in [(x, "gelu"), (x.to(torch.bfloat16), "silu"), (x.t(), "silu"), (x[:, ::2], "silu")]:
        torch.testing.assert_close(cpu_layer_ops.act_and_mul(*args), reference.act_and_mul(*args))
    assert calls == []
