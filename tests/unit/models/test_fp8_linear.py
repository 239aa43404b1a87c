"""FP8Linear (backend/models/fp8.py) on CUDA, torch._scaled_mm, against its CPU path
(inputs rounded through E4M3, then an fp32 matmul of the dequantized weights). Skipped
without a GPU; CI's CPU tests cover the CPU path against transformers."""

import pytest
import torch

from backend.models.fp8 import FP8Linear

# Largest |CUDA - CPU| over the largest |output|, measured on an H100 (2026-11-27): fp32
# 0.9-1.4e-4 (cuBLAS's FP8 GEMM does not accumulate in full fp32), bf16 3-5e-3 (the output's
# rounding). A wrong scale or layout is off by O(1).
BOUND = {torch.float32: 1e-3, torch.bfloat16: 2e-2}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (torch._scaled_mm)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_scaled_mm_equals_the_cpu_path(dtype, dynamic, bias):
    # fp32 with a bias: cuBLAS refuses the fused bias ("Bias is not supported when out_dtype
    # is set to Float32"); FP8Linear adds it after.
    g = torch.Generator().manual_seed(0)
    K, N, M = 64, 160, 7
    state = {"weight": (torch.randn(N, K, generator=g) * 50).to(torch.float8_e4m3fn),
             "weight_scale": torch.rand(N, generator=g) / 100}
    if bias:
        state["bias"] = torch.randn(N, generator=g)
    if not dynamic:
        state["input_scale"] = torch.tensor(0.02)
    cpu, cuda = FP8Linear(K, N, bias, dynamic), FP8Linear(K, N, bias, dynamic)
    cpu.load_state_dict(state, assign=True)
    cuda.load_state_dict({k: v.cuda() for k, v in state.items()}, assign=True)
    x = torch.randn(M, K, generator=g).to(dtype)
    want = cpu(x).float()
    got = cuda(x.cuda())
    assert got.dtype == dtype and got.is_cuda
    assert ((got.float().cpu() - want).abs().max() / want.abs().max()).item() < BOUND[dtype]
