"""The one-launch activation quantizer (backend/ops/quant_rows_triton.py) against the
torch references it replaces: INT8 per token bit for bit (ties rounded half to even, a
zero row), FP8 scales per token and per group exactly, a static scale passed through.
FP8 values are compared on CUDA only: Triton's interpreter rounds fp32 -> E4M3 wrongly
where the mantissa carries into the exponent (31.5 -> 16), the GPU's convert is
round-to-nearest-even (tests/helpers/compile_sm90.py checks the instruction)."""

import pytest
import torch

from backend.models.fp8 import per_token_scale
from backend.models.w8a8 import quantize_per_token
from backend.ops.fp8_quant import FP8_MAX, quantize_per_group
from backend.ops.quant_rows_triton import quantize_rows
from tests.helpers.kernel_device import KERNEL_DEVICE, on_kernel_device

quant = on_kernel_device(quantize_rows)


def rows(dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(5, 3000, generator=torch.Generator().manual_seed(0)) * 3
    x[2] = 0.0                                          # a zero row: the smallest scale, all zeros
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int8_per_token_equals_the_reference(dtype):
    x = rows(dtype)
    q, scale = quant(x, fp8=False)
    want_q, want_scale = quantize_per_token(x)
    assert q.dtype == torch.int8 and torch.equal(q, want_q) and torch.equal(scale, want_scale)


def test_int8_ties_round_half_to_even():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 63.5, -127.0]])
    assert quant(x, fp8=False)[0].tolist() == [[127, 0, 2, 2, 0, -2, 64, -127]]


def _fp8_values_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    if KERNEL_DEVICE.type == "cuda":
        assert torch.equal(got.view(torch.int8), want.view(torch.int8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_per_token_and_per_group_scales(dtype):
    x = rows(dtype)
    q, scale = quant(x, fp8=True)
    want = per_token_scale(x)
    assert q.dtype == torch.float8_e4m3fn and torch.equal(scale, want.reshape(-1))
    _fp8_values_equal(q, (x.float() / want).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
    q, scale = quant(x, fp8=True, group=128)            # 3000 = 23 groups of 128 and one of 56
    want_q, want_scale = quantize_per_group(x, 128)
    assert scale.shape == (5, 24) and torch.equal(scale, want_scale)
    _fp8_values_equal(q, want_q)


def test_fp8_static_scale_passes_through():
    x = rows(torch.float32)
    static = torch.tensor(0.05)
    q, scale = quant(x, fp8=True, static_scale=static)
    assert scale is not None and float(scale) == pytest.approx(0.05)
    _fp8_values_equal(q, (x / static).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
    # Away from rounding carries the interpreter agrees too: |v| < 1 rounds within its binade.
    small = torch.full((1, 16), 0.3)
    assert quant(small, fp8=True, static_scale=torch.tensor(1.0))[0].float().tolist() == \
        [[float(torch.tensor(0.3).to(torch.float8_e4m3fn).float())] * 16]


def test_no_rows():
    q, scale = quant(torch.empty(0, 64), fp8=False)
    assert q.shape == (0, 64) and scale.shape == (0,)
