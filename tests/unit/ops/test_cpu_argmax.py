"""Row-wise argmax in C++ (backend/ops/cpu_argmax.py): torch.argmax's indices exactly,
the first of equal values, a NaN as the largest, on one thread and several."""

import pytest
import torch

from backend.ops import cpu_argmax
from backend.ops.cpu_argmax import argmax_rows


@pytest.fixture(autouse=True)
def built():
    assert cpu_argmax.library() is not None     # else every test below would check torch against itself


def check(x: torch.Tensor) -> None:
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, torch.argmax(x, dim=-1)), (got, torch.argmax(x, dim=-1))


@pytest.mark.parametrize("V", [1, 5, 16, 31, 32, 33, 47, 4096, 32007])
def test_random_rows(V):
    g = torch.Generator().manual_seed(V)
    check(torch.randn(7, V, generator=g))
    check(torch.randint(-3, 3, (9, V), generator=g).float())    # ties everywhere: the first wins


def test_edge_values():
    V = 100
    rows = [torch.full((V,), -float("inf")), torch.zeros(V), torch.full((V,), 2.5)]
    r = torch.randn(V); r[[7, 60]] = float("inf"); rows.append(r)
    r = torch.randn(V); r[[40, 9, 90]] = float("nan"); rows.append(r)      # the first NaN: 9
    r = torch.randn(V); r[3] = float("nan"); r[50] = float("inf"); rows.append(r)
    r = torch.full((V,), -1.0); r[20] = -0.0; r[10] = 0.0; rows.append(r)      # 0.0 == -0.0: the first
    r = torch.full((V,), -1.0); r[V - 1] = 3.0; rows.append(r)                 # in the tail
    r = torch.full((V,), -1.0); r[0] = float("nan"); rows.append(r)
    r = torch.randn(V); r[97] = float("nan"); rows.append(r)                 # a NaN in the tail only
    check(torch.stack(rows))
    short = torch.randn(3, 5)                                               # under two vectors' width
    short[1, 3], short[2, 0] = float("nan"), float("nan")
    check(short)


def test_strided_rows_and_empty_batch():
    wide = torch.randn(6, 300)
    check(wide[:, :257])
    check(wide[::2, 5:200])
    check(torch.empty(0, 50))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rows_split_over_threads(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randint(-50, 50, (37, 32000), generator=torch.Generator().manual_seed(threads)).float()
        x[5, 100] = float("nan")
        check(x)
    finally:
        torch.set_num_threads(before)


def test_other_layouts_and_dtypes_run_torch():
    x = torch.randn(4, 64)
    for y in (x.double(), x.t(), x.bfloat16(), x[0]):
        assert torch.equal(argmax_rows(y), torch.argmax(y, dim=-1))
