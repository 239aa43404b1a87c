"""builder/gptq.py: GPTQ rounding with compressed-tensors' grid. Without correlation
between inputs it is round-to-nearest exactly; with it, the layer's output error on the
calibration inputs falls well below round-to-nearest's."""

import pytest
import torch

pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import fake_quantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

from builder.gptq import gptq_quantize  # noqa: E402


def grid(bits: int, group_size: int):
    """(group args, group qparams, column fake-quantize, round-to-nearest of a whole weight)."""
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True,
                            strategy="channel" if group_size == -1 else "group",
                            group_size=None if group_size == -1 else group_size)
    column = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="channel")

    def qparams(group):
        return calculate_qparams(group.amin(-1), group.amax(-1), args)

    def fq(col, scale, zero):
        return fake_quantize(col[:, None], scale[:, None], zero[:, None], column)[:, 0]

    def rtn(w):
        g = w.shape[1] if group_size == -1 else group_size
        groups = w.reshape(w.shape[0], -1, g)
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        scale, zero = scale.reshape(w.shape[0], -1), zero.reshape(w.shape[0], -1)
        return fake_quantize(w, scale, zero, args), scale
    return qparams, fq, rtn


def output_error(w, q, x):
    return ((x @ (w - q).T).norm() / (x @ w.T).norm()).item()


@pytest.mark.parametrize("bits, group_size", [(4, 32), (8, -1)])
def test_uncorrelated_inputs_give_round_to_nearest(bits, group_size):
    """A diagonal Hessian moves no error between columns: GPTQ must then be
    round-to-nearest, scales and all, bit for bit."""
    torch.manual_seed(0)
    w = torch.randn(48, 128)
    hessian = torch.diag(torch.rand(128) + 0.5).double()
    qparams, fq, rtn = grid(bits, group_size)
    q, scales, _ = gptq_quantize(w, hessian, qparams, fq, group_size, block_size=48)
    want, want_scale = rtn(w)
    assert torch.equal(q, want)
    assert torch.equal(scales, want_scale)


@pytest.mark.parametrize("bits, group_size", [(4, 32), (4, -1), (8, 64)])
def test_correlated_inputs_beat_round_to_nearest(bits, group_size):
    """Inputs with a low-rank correlated part (as activations have): GPTQ's output error
    on those inputs is a fraction of round-to-nearest's (measured: about 1/5), every
    weight sits on the grid (its group's scale times an integer in range), and the
    blocked ("lazy batch") error updates give the integers of one block over all columns,
    but for near-ties that the two summation orders round apart (4 of 8,192 on one
    AVX-512 machine, then the row's compensation follows; none on others)."""
    torch.manual_seed(1)
    n, cols = 2048, 128
    x = torch.randn(n, 8) @ torch.randn(8, cols) + 0.1 * torch.randn(n, cols)
    w = torch.randn(64, cols)
    qparams, fq, rtn = grid(bits, group_size)
    rtn_err = output_error(w, rtn(w)[0], x)
    g = cols if group_size == -1 else group_size
    integers, errors = [], []
    for block_size in (32, cols):
        q, scales, zeros = gptq_quantize(w, (x.T @ x).double(), qparams, fq, group_size, block_size=block_size)
        gptq_err = output_error(w, q, x)
        assert gptq_err < 0.3 * rtn_err, (block_size, gptq_err, rtn_err)
        ints = q / scales.repeat_interleave(g, dim=1)
        assert torch.allclose(ints, ints.round(), atol=1e-3)
        assert ints.round().min() >= -(2 ** (bits - 1)) and ints.round().max() <= 2 ** (bits - 1) - 1
        assert torch.all(zeros == 0)
        integers.append(ints.round())
        errors.append(gptq_err)
    apart = integers[0] != integers[1]
    assert apart.float().mean() < 0.005 and (integers[0] - integers[1]).abs().max() <= 1, apart.sum()
    assert abs(errors[0] - errors[1]) < 0.02 * errors[1], errors


def test_inputs_never_seen_get_zero_weights():
    """A column whose input is always zero contributes nothing; GPTQ zeroes it (as
    AutoGPTQ does) instead of failing on a singular Hessian."""
    torch.manual_seed(2)
    x = torch.randn(256, 64)
    x[:, 5] = 0
    qparams, fq, _ = grid(4, 32)
    q, _, _ = gptq_quantize(torch.randn(16, 64), (x.T @ x).double(), qparams, fq, 32)
    assert torch.all(q[:, 5] == 0) and torch.isfinite(q).all()
