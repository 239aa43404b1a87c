"""The CPU decode-attention kernel (cpu_decode.cpp): built with the system's C++ compiler
at first use, loaded with ctypes, and called once per layer for all of a step's decode
rows, reading K/V in place from the block pool.

Why: on the default model the torch path's decode attention (a gathered copy of each
sequence's blocks, then SDPA over it) was about half of a CPU step (docs/archive/benchmarks.md
section 16); vLLM-CPU's C++ paged kernel reads the blocks where they lie, and so does
this one. Built, cached and loaded by backend/ops/cpu_build.py; ctypes releases the GIL
for the call, so the forward's shard threads (cpu_shards.py) run it side by side.

Where no compiler works, or `PAGED_LLM_CPU_DECODE_KERNEL=0` is set, `kernel()` is None
and the torch path runs (a warning says why, once).
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional

import numpy as np
import torch

from backend.attention.metadata import AttentionMetadata
from backend.ops.cpu_build import CppLibrary, heads_dense, plain_tensors

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_decode.cpp")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
ENV_SWITCH = "PAGED_LLM_CPU_DECODE_KERNEL"

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_LIBRARY = CppLibrary(SOURCE, ENV_SWITCH, {
    "paged_decode": (ctypes.c_int, [ctypes.c_int, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64,
                                    _i64, _i64, _i64, _i64, ctypes.c_float, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr]),
    "write_kv": (ctypes.c_int, [_ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64]),
    "f32_tiles": (ctypes.c_int, [_i64]),
}, "CPU decode-attention kernel")


def kernel() -> Optional[ctypes.CDLL]:
    """The loaded library, or None (torch path) when switched off or not buildable."""
    return _LIBRARY.get()


# Prompt chunks of sequences with at most this many keys (cached ones included) run in
# the kernel too, each prompt token a row of its own that attends to the sequence up to
# itself. Against SDPA's flash kernel per sequence (2 threads, 16/8 heads, D 64, causal,
# /tmp script of 2026-11-27): 2.0x faster at 140 tokens, 1.4x at 256 and 512, 0.9x at
# 1,024 and 0.75x at 2,048 (SDPA tiles the queries; the kernel reads the keys again for
# each row). Chunks after a cached prefix gain more: SDPA then takes an explicit mask.
PREFILL_MAX_KEYS = 512


class DecodePlan:
    """A step's rows for the kernel, made once per step (the first layer's call) and read
    by every layer: each row's query row, block-table row and length (its keys). Decode
    rows, and the prompt tokens of sequences with at most PREFILL_MAX_KEYS keys;
    `covers[i]`: sequence i's rows are all here (the torch path skips it)."""

    def __init__(self, meta: AttentionMetadata) -> None:
        query_lens = np.asarray(meta.query_lens_cpu, dtype=np.int64)
        seq_lens = np.asarray(meta.seq_lens_cpu, dtype=np.int64)
        qsl = np.concatenate([[0], np.cumsum(query_lens)])
        self.covers = (query_lens == 1) | ((query_lens > 1) & (seq_lens <= PREFILL_MAX_KEYS))
        ids = np.flatnonzero(self.covers)
        counts = query_lens[ids]
        # Row j of sequence i: query row qsl[i] + j, keys up to its position: len - n + j + 1.
        j = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        self.num_rows = len(j)
        self.rows = np.ascontiguousarray(np.repeat(qsl[ids], counts) + j, dtype=np.int64)
        self.seq_idx = np.ascontiguousarray(np.repeat(ids, counts), dtype=np.int64)
        self.lens = np.ascontiguousarray(np.repeat(seq_lens[ids] - counts, counts) + j + 1, dtype=np.int64)
        tables = meta.block_tables
        if tables.dtype != torch.int32 or tables.stride(-1) != 1:
            tables = tables.to(torch.int32).contiguous()
        self.tables = tables           # kept alive with the plan: the kernel reads its memory
        # A tree of proposals (AttentionMetadata.tree, on the CPU): each row's tree start
        # and mask, or None.
        self.tree_start = self.tree_bits = None
        if meta.tree is not None:
            nodes = meta.tree.numpy()[self.rows]
            self.tree_start = np.ascontiguousarray(nodes[:, 0])
            self.tree_bits = np.ascontiguousarray(nodes[:, 1])


def decode_plan(meta: AttentionMetadata) -> DecodePlan:
    plans = meta.decode_plan
    if plans is None:
        plans = meta.decode_plan = {}
    plan = plans.get("cpu_kernel")
    if plan is None:
        plan = plans["cpu_kernel"] = DecodePlan(meta)
    return plan


def supports(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, logits_soft_cap, sinks) -> bool:
    """Whether the kernel can serve this layer: CPU tensors of one dtype it knows, no
    soft-cap or sinks (those run the explicit torch path), dense inner layouts, and a
    real call (not a trace, which cannot follow a foreign call)."""
    return (q.device.type == "cpu" and key.device.type == "cpu" and value.device.type == "cpu"
            and q.dtype in DTYPES and key.dtype == q.dtype and value.dtype == q.dtype
            and logits_soft_cap is None and sinks is None and heads_dense(q)
            and key.is_contiguous() and value.is_contiguous() and value.shape == key.shape
            and plain_tensors(q, key, value))


def paged_decode(lib: ctypes.CDLL, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: DecodePlan,
                 scale: float, window: Optional[int], out: torch.Tensor) -> None:
    """out[rows] = attention of q[rows] (the plan's rows) over their sequences' cached K/V.
    q, out: [T, H, D]; key, value: [num_blocks, block_size, KVH, D]."""
    if plan.num_rows == 0:
        return
    _, H, D = q.shape
    _, block_size, kvh, _ = key.shape
    tables = plan.tables
    rc = lib.paged_decode(
        DTYPES[q.dtype], q.data_ptr(), q.stride(0), key.data_ptr(), value.data_ptr(),
        tables.data_ptr(), tables.stride(0), plan.rows.ctypes.data, plan.seq_idx.ctypes.data,
        plan.lens.ctypes.data, plan.num_rows, H, kvh, D, block_size, window or 0, scale,
        out.data_ptr(), out.stride(0), torch.get_num_threads(), tables.shape[1], key.shape[0],
        plan.tree_start.ctypes.data if plan.tree_start is not None else None,
        plan.tree_bits.ctypes.data if plan.tree_bits is not None else None)
    if rc == 4:
        raise RuntimeError("paged_decode: a sequence's block table is shorter than its length or names a block "
                           f"outside the pool of {key.shape[0]}")
    if rc != 0:
        raise RuntimeError(f"paged_decode failed (code {rc}) for H={H}, KVH={kvh}, D={D}, dtype={q.dtype}")


def write_kv(lib: ctypes.CDLL, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """The step's K/V into the pool, as torch_attention.write_kv does for a cache of the
    activations' dtype; False (nothing written) where this layout or dtype is not one it
    copies, for the torch path to do it."""
    if (key.dtype != k_cache.dtype or value.dtype != v_cache.dtype or key.shape != value.shape
            or k_cache.shape != v_cache.shape or k_cache.shape[2:] != key.shape[1:]
            or not k_cache.is_contiguous() or not v_cache.is_contiguous()
            or not heads_dense(key) or not heads_dense(value) or slot_mapping.dtype not in (torch.int32, torch.int64)
            or not slot_mapping.is_contiguous() or slot_mapping.device.type != "cpu"
            or not plain_tensors(key, value, slot_mapping)):
        return False
    elem = key.element_size()
    row_bytes = key.shape[1] * key.shape[2] * elem
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if lib.write_kv(slot_mapping.data_ptr(), slot_mapping.element_size(), key.shape[0], key.data_ptr(),
                    key.stride(0) * elem, value.data_ptr(), value.stride(0) * elem, row_bytes, k_cache.data_ptr(),
                    v_cache.data_ptr(), num_slots):
        raise IndexError(f"a slot lies outside the KV pool's {num_slots} slots")
    return True
