"""The CPU kernel microbenchmark (benchmarks/cpu_kernel_bench.py) runs its cases."""

from benchmarks.cpu_kernel_bench import SHAPES, argmaxes, linears


def test_linears_and_argmax_are_timed():
    times = linears(rows=2, layers=1, reps=1)
    assert set(times) == set(SHAPES) and all(warm > 0 and cold > 0 for warm, cold in times.values())
    ours, ref = argmaxes((3, 1000), reps=2)      # (it checks its answer against torch's first)
    assert ours > 0 and ref > 0
