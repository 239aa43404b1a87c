"""The fused MoE Triton kernel against its torch reference (natively on CUDA where there is
a GPU, through the interpreter on CPU otherwise: tests/helpers/kernel_device.py): fp32
within 1e-5 relative, with experts that receive no tokens and unequal loads; the
block alignment; the routing."""

import pytest
import torch

from backend.ops import fused_moe_triton as kernels
from backend.ops import moe_reference
from tests.helpers.kernel_device import on_kernel_device
from tests.helpers.paged_batch import rel_err
from tests.helpers.pins import require_pinned

fused_moe, route = on_kernel_device(kernels.fused_moe), on_kernel_device(kernels.route)
align_by_expert = on_kernel_device(kernels.align_by_expert)


def skewed_ids(T: int, E: int, K: int, g: torch.Generator) -> torch.Tensor:
    """Top-k ids with unequal loads: expert 0 takes most tokens, the last two none."""
    logits = torch.randn(T, E, generator=g)
    logits[:, 0] += 3.0
    logits[:, E - 2:] -= 100.0
    return torch.topk(logits, K, dim=-1).indices


@pytest.mark.parametrize("T,E,K,H,I", [(1, 4, 2, 32, 24), (37, 8, 2, 48, 40), (90, 6, 3, 64, 72)])
def test_fused_moe_matches_reference(T, E, K, H, I):
    g = torch.Generator().manual_seed(T * E)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    ids = skewed_ids(T, E, K, g)
    weights = torch.rand(T, K, generator=g)
    out = fused_moe(x, w13, w2, weights, ids)
    ref = moe_reference.fused_moe(x, w13, w2, weights, ids)
    assert out.shape == (T, H)
    assert rel_err(out, ref) < 1e-5
    # The idle experts really were idle, and the loads unequal.
    loads = torch.bincount(ids.flatten(), minlength=E)
    assert loads[E - 2:].sum() == 0 and (T == 1 or loads.max() > loads[loads > 0].min())


def test_fused_moe_half_precision_within_rounding():
    """fp16 tiles (tensor-core dots on a GPU). Not bf16: Triton 3.9's interpreter computes
    bf16 tl.dot wrongly (a 16x16 bf16 dot comes out near 1e10), so bf16 is checked by the
    sm_90 compile only."""
    g = torch.Generator().manual_seed(3)
    T, E, K, H, I = 40, 8, 2, 64, 48
    x = torch.randn(T, H, generator=g).half()
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).half()
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).half()
    ids = skewed_ids(T, E, K, g)
    weights = torch.rand(T, K, generator=g)
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == torch.float16
    assert rel_err(out, moe_reference.fused_moe(x, w13, w2, weights, ids)) < 1e-2


def test_slots_of_other_ranks_experts_contribute_nothing():
    """Expert parallelism: ids outside [0, E) (-1) are another rank's experts."""
    g = torch.Generator().manual_seed(7)
    T, E, K, H, I = 29, 4, 2, 32, 40
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    ids = skewed_ids(T, 2 * E, K, g)
    ids = ids.masked_fill(ids >= E, -1)
    weights = torch.rand(T, K, generator=g)
    out = fused_moe(x, w13, w2, weights, ids)
    ref = moe_reference.fused_moe(x, w13, w2, weights, ids)
    # Only the local slots, written out: what the reference computes too.
    kept = moe_reference.fused_moe(x, w13, w2, weights.masked_fill(ids < 0, 0.0), ids.clamp(min=0))
    assert (ids < 0).any() and (ids >= 0).any()
    assert rel_err(out, ref) < 1e-5 and rel_err(ref, kept) < 1e-6


def test_align_by_expert_groups_and_pads():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])     # expert 1 has none
    sorted_ids, block_expert, num_padded = align_by_expert(ids, 4, 4)
    n = ids.numel()
    assert int(num_padded) == 12                    # experts 0, 2, 3: one block of 4 each
    rows = sorted_ids[:12].view(3, 4).tolist()
    assert rows == [[1, 4, n, n], [0, 2, 5, n], [3, n, n, n]]
    assert block_expert[:3].tolist() == [0, 2, 3]


@pytest.mark.parametrize("renormalize", [False, True])
def test_route_softmax_topk(renormalize):
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    w, ids = moe_reference.route(logits, 2, renormalize)
    p = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[1, 2]]
    expect = torch.stack([p[1], p[2]])
    if renormalize:
        expect = expect / expect.sum()
    assert torch.allclose(w[0], expect)


@pytest.mark.parametrize("T,E,K", [(5, 4, 2), (33, 60, 4), (9, 128, 8), (3, 6, 1)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_triton_route_matches_reference(T, E, K, renormalize):
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(E + K)) * 3
    w, ids = route(logits, K, renormalize)
    ref_w, ref_ids = moe_reference.route(logits, K, renormalize)
    assert torch.equal(ids, ref_ids)
    assert torch.allclose(w, ref_w, rtol=1e-6, atol=1e-7)


def test_gpt_oss_experts_and_routing_match_reference():
    """gpt-oss: expert biases after both GEMMs and the clamped SwiGLU (limit 1.0 binds
    most gate/up values here) in the kernel; top-k of the logits then a softmax over
    those k, in the routing kernel. The reference itself against transformers'
    GptOssExperts / GptOssTopKRouter (interleaved gate/up columns, [E, in, out] weights)."""
    require_pinned("transformers")    # other versions' references differ: tests/helpers/pins.py
    import transformers as tf
    g = torch.Generator().manual_seed(5)
    T, E, K, H, I = 19, 6, 2, 48, 40
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    b13, b2 = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    logits = torch.randn(T, E, generator=g) * 3
    logits[:, E - 1] -= 100.0                                   # one idle expert
    weights, ids = moe_reference.route(logits, K, False, softmax_after_topk=True)
    tw, tids = route(logits, K, False, softmax_after_topk=True)
    assert torch.equal(tids, ids) and torch.allclose(tw, weights, rtol=1e-6, atol=1e-7)
    kw = dict(b13=b13, b2=b2, alpha=1.702, limit=1.0)
    ref = moe_reference.fused_moe(x, w13, w2, weights, ids, "swigluoai", **kw)
    assert rel_err(fused_moe(x, w13, w2, weights, ids, "swigluoai", **kw), ref) < 1e-5
    assert rel_err(moe_reference.fused_moe(x, w13, w2, weights, ids, "swigluoai", **{**kw, "limit": 7.0}), ref) > 1e-2

    cfg = tf.GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K,
                          swiglu_limit=1.0)
    experts, router = tf.models.gpt_oss.modeling_gpt_oss.GptOssExperts(cfg), \
        tf.models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter(cfg)
    gate, up = w13[:, :I], w13[:, I:]
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.stack([gate, up], dim=2).reshape(E, 2 * I, H).transpose(1, 2))
        experts.gate_up_proj_bias.copy_(torch.stack([b13[:, :I], b13[:, I:]], dim=2).reshape(E, 2 * I))
        experts.down_proj.copy_(w2.transpose(1, 2))
        experts.down_proj_bias.copy_(b2)
        router.weight.copy_(torch.randn(E, H, generator=g))
        router.bias.copy_(torch.randn(E, generator=g))
        _, hf_weights, hf_ids = router(x)
        w_ref, ids_ref = moe_reference.route(torch.nn.functional.linear(x, router.weight, router.bias), K, False,
                                             softmax_after_topk=True)
        assert torch.equal(ids_ref, hf_ids) and torch.allclose(w_ref, hf_weights, rtol=1e-6, atol=1e-7)
        hf = experts(x, ids, weights)
    assert rel_err(ref, hf) < 1e-5


def test_mxfp4_weights_decoded_in_the_kernel_tiles():
    """gpt-oss's experts kept 4-bit: the kernel decodes packed bytes and E8M0 scales in
    its tiles; equal to the reference on the dequantized weights (fp32, <= 1e-5), with
    a K not a multiple of the 64-wide K tile."""
    from tests.helpers.mxfp4_pack import pack_mxfp4, unpack_mxfp4
    g = torch.Generator().manual_seed(11)
    T, E, K, H, I = 21, 4, 2, 96, 32
    x = torch.randn(T, H, generator=g)
    packed13, s13 = pack_mxfp4(torch.randn(E, 2 * I, H, generator=g) / H ** 0.5)
    packed2, s2 = pack_mxfp4(torch.randn(E, H, I, generator=g) / I ** 0.5)
    b13, b2 = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    ids = skewed_ids(T, E, K, g)
    weights = torch.rand(T, K, generator=g)
    w13, w2 = packed13.flatten(-2), packed2.flatten(-2)              # [E, rows, in / 2]
    kw = dict(b13=b13, b2=b2, limit=2.0)
    ref = moe_reference.fused_moe(x, unpack_mxfp4(packed13, s13), unpack_mxfp4(packed2, s2), weights, ids,
                                  "swigluoai", **kw)
    assert torch.equal(moe_reference.fused_moe(x, w13, w2, weights, ids, "swigluoai", w13_scale=s13, w2_scale=s2,
                                               **kw), ref)
    out = fused_moe(x, w13, w2, weights, ids, "swigluoai", w13_scale=s13, w2_scale=s2, **kw)
    assert rel_err(out, ref) < 1e-5


def test_mxfp4_bf16_takes_the_scaled_dot_and_matches_the_reference():
    """bf16 activations take `tl.dot_scaled` (bytes read once, upcast by the compiler;
    the tile's exactness is test_mxfp4_triton.py's): within bf16's rounding of the
    reference on the exactly dequantized weights, with K tails of 32 (not a multiple of
    the 64-wide tile) in both GEMMs and a slot of another rank's experts that adds
    nothing; the fp32 decode path agrees. The bound is loose because Triton 3.9's
    interpreter truncates fp32 to bf16 where CUDA rounds (half its conversions differ
    from torch's), and the kernel rounds after each GEMM and activation step: 1.7% here
    against 0.5% for torch's bf16 reference; a misread nibble or scale is off by ~100%."""
    from tests.helpers.mxfp4_pack import pack_mxfp4, unpack_mxfp4
    g = torch.Generator().manual_seed(5)
    T, E, K, H, I = 19, 4, 2, 96, 32
    x = torch.randn(T, H, generator=g)
    packed13, s13 = pack_mxfp4(torch.randn(E, 2 * I, H, generator=g) / H ** 0.5)
    packed2, s2 = pack_mxfp4(torch.randn(E, H, I, generator=g) / I ** 0.5)
    b13, b2 = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    ids = skewed_ids(T, E, K, g)
    ids[3, 0] = -1
    weights = torch.rand(T, K, generator=g)
    w13, w2 = packed13.flatten(-2), packed2.flatten(-2)
    kw = dict(w13_scale=s13, w2_scale=s2, limit=2.0)
    dense = (unpack_mxfp4(packed13, s13).bfloat16(), unpack_mxfp4(packed2, s2).bfloat16())
    ref = moe_reference.fused_moe(x.bfloat16(), *dense, weights, ids, "swigluoai", b13.bfloat16(), b2.bfloat16(),
                                  limit=2.0)
    out = fused_moe(x.bfloat16(), w13, w2, weights, ids, "swigluoai", b13.bfloat16(), b2.bfloat16(), **kw)
    assert out.dtype == torch.bfloat16 and rel_err(out.float(), ref.float()) < 3e-2
    exact = fused_moe(x, w13, w2, weights, ids, "swigluoai", b13, b2, **kw)
    assert rel_err(out.float(), exact) < 3e-2


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 1e-2)])
def test_fp8_experts_dequantized_in_the_tiles_match_the_reference(dtype, tol):
    """FP8 E4M3 experts with per-expert, per-channel fp32 scales (FP8 MoE builds): the
    kernel dequantizes each tile as the reference dequantizes the stack (fp8 * scale,
    rounded to the activation dtype); slots of another rank's experts still count nothing."""
    from backend.models.moe_fp8 import quantize_experts
    from backend.ops.fp8_quant import dequantize_experts
    g = torch.Generator().manual_seed(11)
    T, E, K, H, I = 37, 6, 2, 64, 40
    x = torch.randn(T, H, generator=g).to(dtype)
    w13, s13 = quantize_experts(torch.randn(E, 2 * I, H, generator=g) * torch.rand(E, 2 * I, 1, generator=g))
    w2, s2 = quantize_experts(torch.randn(E, H, I, generator=g) / I ** 0.5)
    ids = skewed_ids(T, E, K, g)
    ids[0, 1] = -1
    weights = torch.rand(T, K, generator=g)
    out = fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2)
    ref = moe_reference.fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2)
    plain = moe_reference.fused_moe(x, dequantize_experts(w13, s13).to(dtype), dequantize_experts(w2, s2).to(dtype),
                                    weights, ids)
    assert w13.dtype == torch.float8_e4m3fn and out.dtype == dtype
    assert torch.equal(ref, plain) and rel_err(out, ref) < tol
