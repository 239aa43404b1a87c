"""The device's copy bandwidth: the memory-bound floor that the GPU check and the kernel
benchmarks measure their kernels against."""

import time

import torch


def copy_bandwidth_gbs(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth (reads + writes) in GB/s."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        b.copy_(a)
    torch.cuda.synchronize()
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes * iters / (time.perf_counter() - t0) / 1e9
