"""CPU kernels alone: the oneDNN-packed projections of the hidden-1024 Llama, and the
sampler's argmax against torch's. The figures behind benchmarks §16's "where the rest
goes" (the decode step in the engine: benchmarks.cpu_step_parts).

    python -m benchmarks.cpu_kernel_bench [--rows 32 64] [--argmax 32x32000 256x32000 32x151936]

- linears: each projection of `benchmarks.bench_vllm_peer`'s hidden-1024 Llama (qkv 1024 ->
  2048, o 1024 -> 1024, gate/up 1024 -> 5632, down 2816 -> 1024, fp32), packed as the
  engine packs them, at each row count. `warm`: one layer's weight, called again and
  again (it stays in the cache); `cold`: eight layers' projections in a forward's order
  (a layer's 46.6 MB do not fit the last-level cache). In us a call and GFLOP/s, and
  the eight layers' sum.
- argmax: backend.ops.cpu_argmax.argmax_rows against torch.argmax(x, -1), in us.
"""

from __future__ import annotations

import argparse
import time

import backend  # noqa: F401  (first: PASSIVE OpenMP and THP, as the engine runs)
from benchmarks.attention_bench import _time_ms

SHAPES = {"qkv_proj": (1024, 2048), "o_proj": (1024, 1024), "gate_up_proj": (1024, 5632), "down_proj": (2816, 1024)}


def per_call_us(fn, reps: int) -> float:
    import torch
    return _time_ms(fn, reps, torch.device("cpu")) * 1e3


def linears(rows: int, layers: int = 8, reps: int = 20) -> dict[str, tuple[float, float]]:
    """{projection: (warm us, cold us)} per call at `rows` rows."""
    import torch
    from backend.models.cpu_packed_linear import PackedLinear
    torch.manual_seed(0)
    stack = [{k: PackedLinear(torch.nn.Linear(i, o, bias=False)) for k, (i, o) in SHAPES.items()}
             for _ in range(layers)]
    xs = {k: torch.randn(rows, i) for k, (i, _) in SHAPES.items()}
    warm = {k: per_call_us(lambda: stack[0][k](xs[k]), reps * 5) for k in SHAPES}
    cold = dict.fromkeys(SHAPES, 0.0)
    for _ in range(reps):
        for layer in stack:                 # in a forward's order: each weight comes from memory
            for k in SHAPES:
                t = time.perf_counter()
                layer[k](xs[k])
                cold[k] += time.perf_counter() - t
    return {k: (warm[k], cold[k] / (reps * layers) * 1e6) for k in SHAPES}


def argmaxes(shape: tuple[int, int], reps: int = 100) -> tuple[float, float]:
    """(ours us, torch us) for a [R, V] fp32 input."""
    import torch
    from backend.ops.cpu_argmax import argmax_rows
    x = torch.randn(*shape)
    if not torch.equal(argmax_rows(x), x.argmax(dim=-1)):
        raise AssertionError("argmax_rows disagrees with torch.argmax")
    return per_call_us(lambda: argmax_rows(x), reps), per_call_us(lambda: x.argmax(dim=-1), reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="*", default=[32, 64])
    ap.add_argument("--argmax", nargs="*", default=["32x32000", "256x32000", "32x151936"])
    a = ap.parse_args()
    import torch
    print(f"{torch.get_num_threads()} threads")
    for rows in a.rows:
        times = linears(rows)
        for k, (warm, cold) in times.items():
            i, o = SHAPES[k]
            flop = 2 * rows * i * o
            print(f"linear {k:13s} rows {rows:4d}: warm {warm:7.1f} us ({flop / warm / 1e3:5.0f} GFLOP/s), "
                  f"cold {cold:7.1f} us ({flop / cold / 1e3:5.0f} GFLOP/s)")
        print(f"8 layers' linears, rows {rows}: warm {8 * sum(w for w, _ in times.values()) / 1e3:.2f} ms, "
              f"cold {8 * sum(c for _, c in times.values()) / 1e3:.2f} ms")
    for spec in a.argmax:
        R, V = (int(n) for n in spec.split("x"))
        ours, ref = argmaxes((R, V))
        print(f"argmax {R} x {V}: ours {ours:7.1f} us, torch {ref:7.1f} us ({ref / ours:.2f}x)")


if __name__ == "__main__":
    main()
