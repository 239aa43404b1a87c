"""Row-wise argmax on the CPU in C++ (cpu_argmax.cpp), fp32: torch.argmax(x, dim=-1),
the same indices, 2-3x faster (torch's keeps one pair per row and compares element by
element). Every sampled token ends in one: greedy rows take the argmax of their logits,
drawn rows the argmax of p / E. Anything else (another device or dtype, a layout with
strided rows' elements) runs torch's. `PAGED_LLM_CPU_ARGMAX=0` keeps torch's.
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch

from backend.ops.cpu_build import CppLibrary, plain_tensors, rows_f32

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_argmax.cpp")
ENV_SWITCH = "PAGED_LLM_CPU_ARGMAX"

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_LIBRARY = CppLibrary(SOURCE, ENV_SWITCH, {
    "argmax_rows_f32": (None, [_ptr, _i64, _i64, _i64, _ptr, _i64]),
}, "CPU argmax")


def library() -> Optional[ctypes.CDLL]:
    return _LIBRARY.get()


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a [R, V] tensor: int64 [R], on x's device."""
    if (not rows_f32(x) or not 0 < x.shape[1] < 2 ** 31 or x.requires_grad or not plain_tensors(x)
            or (lib := library()) is None):
        return x.argmax(dim=-1)
    R, V = x.shape
    out = torch.empty(R, dtype=torch.int64)
    lib.argmax_rows_f32(x.data_ptr(), x.stride(0), R, V, out.data_ptr(), torch.get_num_threads())
    return out
