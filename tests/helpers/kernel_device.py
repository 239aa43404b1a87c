"""Where the Triton kernel tests run their kernels: on CUDA when there is a GPU (compiled,
no interpreter: tests/conftest.py sets TRITON_INTERPRET only without one), on CPU tensors
through the interpreter otherwise. The tests build inputs and references on the CPU
(seeded CPU generators) and move only the kernel's call."""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.utils._pytree import tree_map

KERNEL_DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def to_kernel_device(x):
    return x.to(KERNEL_DEVICE) if isinstance(x, torch.Tensor) else x


def on_kernel_device(fn: Callable) -> Callable:
    """fn with its tensor arguments moved to KERNEL_DEVICE and its tensor results brought
    back to the CPU (for kernels that return their results, not ones that write in place)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        args, kwargs = tree_map(to_kernel_device, (args, kwargs))
        out = fn(*args, **kwargs)
        return tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, out)
    return call
