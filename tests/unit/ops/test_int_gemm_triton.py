"""The W4A16 / W8A16 Triton GEMMs (backend/ops/int_gemm_triton.py) against dequantize +
matmul: the blocked kernel over its re-packed layout (groups in order, split K, the
16-bit mantissa trick) and the gathering kernel with split K. On CPU through the
interpreter (fp32 and fp16: the interpreter mis-handles bf16 tensors, so bf16's bit
trick is checked in torch and the bf16 build by tests/helpers/compile_sm90.py)."""

import pytest
import torch

from backend.models import int_formats
from backend.models.int_formats import IntWeight
from backend.models.int_types import pack_along_k
from backend.ops import int_gemm_triton as ig
from tests.helpers.kernel_device import on_kernel_device


def quantized(K: int, N: int, bits: int, group_size: int, seed: int = 0):
    """(IntWeight with in-order groups, its [N, K] fp32 dequantization)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (K, N), generator=g)
    groups = 1 if group_size == -1 else K // group_size
    scales = torch.rand(groups, N, generator=g) * 0.1 + 0.01
    zeros = torch.randint(0, 1 << bits, (groups, N), generator=g).float()
    g_idx = (torch.arange(K) // (K if group_size == -1 else group_size)).to(torch.int32)
    w = IntWeight(pack_along_k(q, bits), scales, zeros, g_idx, None)
    return w, int_formats.dequantize(w, bits)


@pytest.mark.parametrize("M, K, N, bits, group_size, split_k", [
    (1, 256, 128, 4, 128, None),       # decode row; the planner splits K (4 SMs off CUDA)
    (5, 512, 192, 4, 128, 3),          # N not a tile multiple; 3 splits asked, 2 equal ones of 2 K steps
    (17, 256, 128, 4, -1, None),       # per-channel scales; two M tiles
    (3, 256, 64, 8, 64, 4),            # 8-bit: 64-row K steps
    (70, 128, 64, 8, 128, 1),          # the largest M bucket
    (2, 1024, 64, 4, 256, 8),          # groups of two K steps
])
def test_blocked_kernel_equals_the_reference(M, K, N, bits, group_size, split_k):
    w, dense = quantized(K, N, bits, group_size)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1))
    blocked = ig.block_for_kernel(w.qweight, bits)
    got = on_kernel_device(ig.int_gemm_blocked)(x, blocked, w.scales, w.zeros, bits, group_size, split_k=split_k)
    torch.testing.assert_close(got, x @ dense.t(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_blocked_kernel_in_fp16_within_fp16_rounding(bits):
    """16-bit activations: 4-bit codes become floats by the mantissa trick (1024 + q in
    fp16), the offset folded into the zero; 8-bit codes are converted."""
    w, dense = quantized(256, 128, bits, 128, seed=2)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3)).half()
    got = on_kernel_device(ig.int_gemm_blocked)(x, ig.block_for_kernel(w.qweight, bits), w.scales.half(), w.zeros,
                                                 bits, 128, split_k=2)
    want = x.float() @ dense.t()
    assert got.dtype == torch.float16
    assert ((got.float() - want).abs().max() / want.abs().max()).item() < 2e-3


def test_the_mantissa_trick_gives_offset_plus_code():
    """What the kernel's MAGIC does, for every 4-bit code: bf16 bits 0x4300 | q is 128 + q,
    fp16 bits 0x6400 | q is 1024 + q, exactly."""
    q = torch.arange(16, dtype=torch.int32)
    assert torch.equal((q | 0x4300).to(torch.int16).view(torch.bfloat16).float(), 128.0 + q.float())
    assert torch.equal((q | 0x6400).to(torch.int16).view(torch.float16).float(), 1024.0 + q.float())


@pytest.mark.parametrize("bits", [4, 8])
def test_block_for_kernel_puts_rows_j16_plus_r_in_word_bits_j(bits):
    per = 32 // bits
    K, N = 2 * 16 * per, 3
    codes = torch.randint(0, 1 << bits, (K, N), generator=torch.Generator().manual_seed(4))
    blocked = ig.block_for_kernel(pack_along_k(codes, bits), bits)
    for step in range(2):
        for j in range(per):
            for r in (0, 7, 15):
                got = (blocked[step * 16 + r] >> (j * bits)) & ((1 << bits) - 1)
                assert torch.equal(got, codes[step * 16 * per + j * 16 + r].to(torch.int32))


def test_gather_kernel_with_split_k_keeps_act_order():
    """The gathering kernel (act order: g_idx a permutation of groups) split along K."""
    K, N, bits = 256, 64, 4
    w, _ = quantized(K, N, bits, 32, seed=5)
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(6))
    w = IntWeight(w.qweight, w.scales, w.zeros, w.g_idx[perm].contiguous(), None)
    dense = int_formats.dequantize(w, bits)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(7))
    for split_k in (1, 3):
        got = on_kernel_device(ig.int_gemm)(x, w.qweight, w.scales, w.zeros, w.g_idx, bits, split_k=split_k)
        torch.testing.assert_close(got, x @ dense.t(), rtol=1e-4, atol=1e-4)


def test_plan_splits_fills_two_waves_with_equal_whole_splits():
    from backend.ops.gemm_tiles import plan_splits, tile_config
    # 8B down_proj at decode: 64 tiles of 64 columns, 112 K steps, 132 SMs -> 5 splits of 23 steps.
    assert plan_splits(64, 112, 132) == (5, 23)
    assert plan_splits(1024, 32, 132) == (1, 32)         # enough tiles: no split
    assert plan_splits(4, 3, 132) == (3, 1)              # never more splits than K steps
    assert plan_splits(4, 10, 132, split_k=4) == (4, 3)  # forced: 3 + 3 + 3 + 1 steps
    tiles = ig.TILES
    assert tile_config(1, tiles)[0] == 16 and tile_config(64, tiles)[0] == 64 and tile_config(4096, tiles)[1] == 128


@pytest.mark.parametrize("K, bits, group_size, ok", [
    (4096, 4, 128, True), (4096, 4, -1, True), (4096, 8, 64, True), (4096, 4, 64, False), (4096, 8, 32, False),
    (4160, 4, 128, False)])
def test_blocked_eligible(K, bits, group_size, ok):
    assert ig.blocked_eligible(K, bits, group_size) is ok


def test_no_rows():
    w, _ = quantized(256, 64, 4, 128)
    out = ig.int_gemm_blocked(torch.empty(0, 256), ig.block_for_kernel(w.qweight, 4), w.scales, w.zeros, 4, 128)
    assert out.shape == (0, 64)
