"""Each fused Triton kernel against its torch reference (natively on CUDA where there is a
GPU, through the interpreter on CPU otherwise: tests/helpers/kernel_device.py): fp32 within
1e-5 relative, bf16 within bf16 rounding. Odd sizes, strided inputs (views into a
fused GEMM output), Qwen3's q/k norm."""

import pytest
import torch

from backend.models.rotary import RotaryEmbedding
from backend.ops import reference, triton_kernels
from tests.helpers.kernel_device import KERNEL_DEVICE, on_kernel_device, to_kernel_device
from tests.helpers.paged_batch import rel_err

add_rms_norm, act_and_mul = on_kernel_device(triton_kernels.add_rms_norm), on_kernel_device(triton_kernels.act_and_mul)
rotary = on_kernel_device(triton_kernels.rotary)

FP32_TOL = 1e-5


@pytest.mark.parametrize("hidden", [64, 100])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_reference(hidden, with_residual, dtype):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(7, hidden, generator=g).to(dtype)
    res = torch.randn(7, hidden, generator=g).to(dtype) if with_residual else None
    w = (1 + 0.3 * torch.randn(hidden, generator=g)).to(dtype)
    out, new_res = add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_res = reference.add_rms_norm(x, res, w, 1e-5)
    tol = FP32_TOL if dtype == torch.float32 else 1e-2
    assert rel_err(out, ref_out) < tol
    if dtype == torch.float32:
        assert torch.equal(new_res, ref_res)      # the add itself is exact
    else:
        # Triton 3.9's interpreter truncates fp32 -> bf16 casts where GPUs (and torch)
        # round to nearest: one bf16 ulp apart at most.
        ulp = 2.0 ** (torch.floor(torch.log2(ref_res.float().abs().clamp(min=1e-30))) - 7)
        assert ((new_res.float() - ref_res.float()).abs() <= ulp).all()
    assert out.dtype == dtype and new_res.dtype == dtype


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (6, 1, 24), (8, 8, 64)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_in_place_on_fused_qkv_views(heads, kv_heads, head_dim, qk_norm):
    g = torch.Generator().manual_seed(heads * head_dim)
    T = 9
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g)
    q = qkv[:, :heads * head_dim].view(T, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(T, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    positions = torch.tensor([0, 1, 2, 7, 100, 3, 511, 42, 5], dtype=torch.int32)
    norms = ((1 + 0.2 * torch.randn(head_dim, generator=g), 1 + 0.2 * torch.randn(head_dim, generator=g), 1e-6)
             if qk_norm else (None, None, 0.0))
    ref_q, ref_k = reference.rotary(positions.long(), q.clone(), k.clone(), rope.cos_cache, rope.sin_cache, *norms)
    dev_qkv = qkv.to(KERNEL_DEVICE)                 # in place: the views must be the kernel device's
    dev_q = dev_qkv[:, :heads * head_dim].view(T, heads, head_dim)
    dev_k = dev_qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(T, kv_heads, head_dim)
    got_q, got_k = triton_kernels.rotary(*map(to_kernel_device, (positions, dev_q, dev_k, rope.cos_cache,
                                                                  rope.sin_cache, *norms)))
    assert got_q.data_ptr() == dev_q.data_ptr()     # in place, inside the qkv buffer
    assert rel_err(got_q.cpu(), ref_q) < FP32_TOL and rel_err(got_k.cpu(), ref_k) < FP32_TOL
    assert torch.equal(dev_qkv[:, (heads + kv_heads) * head_dim:].cpu(), v_before)   # v untouched


@pytest.mark.parametrize("inter", [40, 1500])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_reference(inter, dtype):
    g = torch.Generator().manual_seed(inter)
    x = (3 * torch.randn(5, 2 * inter, generator=g)).to(dtype)
    got = act_and_mul(x, "silu")
    ref = reference.act_and_mul(x, "silu")
    assert rel_err(got, ref) < (FP32_TOL if dtype == torch.float32 else 1e-2)


def test_other_activations_use_the_reference():
    x = torch.randn(3, 8, device=KERNEL_DEVICE)        # the same device: the same torch ops, bit for bit
    assert torch.equal(triton_kernels.act_and_mul(x, "gelu_pytorch_tanh"), reference.act_and_mul(x, "gelu_pytorch_tanh"))


def test_empty_batch_launches_nothing():
    x = torch.empty(0, 16)
    out, res = add_rms_norm(x, None, torch.ones(16), 1e-5)
    assert out.shape == (0, 16)
    assert act_and_mul(torch.empty(0, 8), "silu").shape == (0, 4)


@pytest.mark.parametrize("head_dim,rotary_dim", [(16, 8), (24, 18)])
def test_partial_rotary_rotates_the_first_channels_only(head_dim, rotary_dim):
    """partial_rotary_factor (Phi-4-mini): the table covers rotary_dim channels; those
    rotate among themselves (pairs rotary_dim / 2 apart), the rest pass unchanged."""
    g = torch.Generator().manual_seed(head_dim)
    T = 5
    rope = RotaryEmbedding(rotary_dim, 128, 10000.0, None)
    q, k = torch.randn(T, 4, head_dim, generator=g), torch.randn(T, 2, head_dim, generator=g)
    positions = torch.tensor([0, 3, 9, 127, 64], dtype=torch.int32)
    ref_q, ref_k = reference.rotary(positions.long(), q.clone(), k.clone(), rope.cos_cache, rope.sin_cache)
    assert torch.equal(ref_q[..., rotary_dim:], q[..., rotary_dim:])
    full = RotaryEmbedding(rotary_dim, 128, 10000.0, None)
    rot_q, _ = reference.rotary(positions.long(), q[..., :rotary_dim].clone(), k[..., :rotary_dim].clone(),
                                full.cos_cache, full.sin_cache)
    assert torch.equal(ref_q[..., :rotary_dim], rot_q)
    got_q, got_k = rotary(positions, q.clone(), k.clone(), rope.cos_cache, rope.sin_cache)
    assert rel_err(got_q, ref_q) < FP32_TOL and rel_err(got_k, ref_k) < FP32_TOL
    assert torch.equal(got_q[..., rotary_dim:], q[..., rotary_dim:])
