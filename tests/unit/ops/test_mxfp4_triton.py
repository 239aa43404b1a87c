"""backend/ops/mxfp4_triton.py: MXFP4 weight tiles in the fused MoE GEMM, against the
exact dequantization (backend/ops/mxfp4.py), through small kernels of the test's own that
call each device function as the grouped GEMM does (interpreter on CPU, compiled on CUDA)."""

import pytest
import torch
import triton
import triton.language as tl

from backend.ops import mxfp4
from backend.ops.mxfp4_triton import dot_tile, load_weight_tile
from tests.helpers.kernel_device import KERNEL_DEVICE


@triton.jit
def _dot_kernel(a_ptr, w_ptr, s_ptr, o_ptr, N, K, M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.arange(0, M)
    n = tl.arange(0, BLOCK_N)
    acc = tl.zeros((M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + m[:, None] * K + ks[None, :], mask=(ks < K)[None, :], other=0.0)
        acc = dot_tile(a, acc, w_ptr, s_ptr, n, k0, K, n < N, K // 2, K // 32, BLOCK_K)
    tl.store(o_ptr + m[:, None] * N + n[None, :], acc, mask=(n < N)[None, :])


@triton.jit
def _tile_kernel(w_ptr, s_ptr, o_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    mask = (ks < K)[:, None] & (n < N)[None, :]
    w = load_weight_tile(w_ptr, s_ptr, n, ks, mask, K // 2, K // 32, tl.float32, True)
    tl.store(o_ptr + n[None, :] * K + ks[:, None], w, mask=mask)


def _weights(N: int, K: int, g: torch.Generator):
    """Every byte value and scales across the range, from 2^-40 to 2^40 (products stay
    normal in fp32)."""
    packed = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(87, 168, (N, K // 32), dtype=torch.uint8, generator=g)
    return packed, scales, mxfp4.dequantize(packed.view(N, K // 32, 16), scales, torch.float32)


@pytest.mark.parametrize("K", [32, 64, 96, 160])
def test_dot_tile_equals_the_product_with_the_dequantized_weights(K):
    """bf16 activations times MXFP4 weights by `tl.dot_scaled`: the fp32 product with the
    exact weights, K tails of 32 inside the 64-wide step, N masked inside its tile."""
    g = torch.Generator().manual_seed(K)
    M, N = 16, 24
    packed, scales, dense = _weights(N, K, g)
    a = torch.randn(M, K, generator=g).to(torch.bfloat16)
    out = torch.full((M, N), float("nan"), device=KERNEL_DEVICE)
    _dot_kernel[(1,)](a.to(KERNEL_DEVICE), packed.to(KERNEL_DEVICE), scales.to(KERNEL_DEVICE), out, N, K, M=M,
                      BLOCK_N=32, BLOCK_K=64)
    ref = a.double() @ dense.double().T
    err = (out.cpu().double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-6


def test_dot_tile_reads_the_low_nibble_first():
    """One weight row with a single code: code 2 (1.0) in the low nibble of byte 0 is
    element 0, code 4 (2.0) in the high nibble is element 1 (the OCP and gpt-oss order)."""
    K, M = 32, 16
    packed = torch.zeros(1, K // 2, dtype=torch.uint8)
    packed[0, 0] = 0x42
    scales = torch.full((1, 1), 127, dtype=torch.uint8)
    a = torch.zeros(M, K, dtype=torch.bfloat16)
    a[0, 0], a[1, 1] = 1.0, 1.0
    out = torch.zeros(M, 1, device=KERNEL_DEVICE)
    _dot_kernel[(1,)](a.to(KERNEL_DEVICE), packed.to(KERNEL_DEVICE), scales.to(KERNEL_DEVICE), out, 1, K, M=M,
                      BLOCK_N=16, BLOCK_K=64)
    assert out.cpu()[:3, 0].tolist() == [1.0, 2.0, 0.0]


def test_load_weight_tile_decodes_exactly():
    """The fp32 path's decode (two exp2s a code): every value equal to the dequantization."""
    g = torch.Generator().manual_seed(3)
    N, K = 24, 96
    packed, scales, dense = _weights(N, K, g)
    out = torch.zeros(N, K, device=KERNEL_DEVICE)
    _tile_kernel[(1,)](packed.to(KERNEL_DEVICE), scales.to(KERNEL_DEVICE), out, N, K, BLOCK_N=32, BLOCK_K=128)
    assert torch.equal(out.cpu(), dense)
