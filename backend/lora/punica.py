"""The per-token LoRA delta of a batch that mixes adapters (punica's SGMV idea): the
step's packed rows are grouped by adapter slot, and each group runs two small GEMMs
against its slot's weights:

    shrink:  y[rows of s]               = x[rows of s] @ A[s]^T          [n, K] -> [n, R]
    expand:  out[rows of s, cols]      += (y[rows of s] @ B[s]^T) * scaling[s]

R is max_lora_rank; an adapter of lower rank has zero rows in A and zero columns in B,
which add exactly nothing. Rows of the base model (no adapter) are in no group.

`LoRAMetadata` is built once per step on the host (numpy) and uploaded in one copy into
a buffer of fixed addresses (slot_starts first, then the rows), so a captured CUDA graph
reads each step's groups from where it recorded them; the layers only read it. Two implementations with the same arguments: torch (the reference,
CPU) and Triton (backend/ops/lora_triton.py: one launch per call, grid over slots x row
tiles x column tiles; tiles past a slot's rows exit at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from backend.engine.runner.buffers import StagedBuffer


@dataclass
class LoRAMetadata:
    sorted_rows: torch.Tensor       # int32 [n]: packed rows under some adapter, grouped by slot
    slot_starts: torch.Tensor       # int32 [S + 1]: slot s owns sorted_rows[starts[s]:starts[s + 1]]
    slot_starts_cpu: Optional[list[int]]    # the same on the host (the torch path slices with it)
    max_rows_per_slot: int          # the Triton grid's row-tile extent
    # The torch path's all-at-once form: the slots in use, and each row's index among them
    # (-1: the base model).
    active_slots: Optional[torch.Tensor] = None     # int32 [A]
    row_active: Optional[torch.Tensor] = None       # int32 [T]


class LoRAMetadataBuilder:
    def __init__(self, max_num_tokens: int, num_slots: int, device: torch.device) -> None:
        self.S, self.T = num_slots, max_num_tokens
        # [slot_starts S + 1 | sorted_rows T | row_active T | active_slots S]
        self.buffer = StagedBuffer(2 * max_num_tokens + 2 * num_slots + 1, torch.int32, device)

    def build(self, slots: list[int], num_new_tokens: list[int], always: bool = False) -> Optional[LoRAMetadata]:
        """slots[i]: request i's adapter slot (-1: the base model); it adds
        num_new_tokens[i] packed rows. None when no row has an adapter, unless `always`
        (a graph replay reads the buffer whatever the step holds)."""
        token_slots = np.repeat(np.asarray(slots, dtype=np.int64), num_new_tokens)
        under = token_slots >= 0
        n = int(under.sum())
        if n == 0 and not always:
            return None
        S = self.S
        counts = np.bincount(token_slots[under], minlength=S)
        host = self.buffer.writable()
        starts = host[:S + 1]
        starts[0] = 0
        np.cumsum(counts, out=starts[1:])
        # A stable sort keeps each group's rows in packed order.
        host[S + 1:S + 1 + n] = np.argsort(token_slots, kind="stable")[len(token_slots) - n:]
        T, at = len(token_slots), S + 1 + self.T
        active = np.flatnonzero(counts)
        compact = np.full(S + 1, -1, dtype=np.int64)        # slot -> index among the active; -1 -> -1
        compact[active] = np.arange(len(active))
        host[at:at + T] = compact[token_slots]
        host[at + self.T:at + self.T + len(active)] = active
        dev = self.buffer.upload(at + self.T + len(active))
        return LoRAMetadata(sorted_rows=dev[S + 1:S + 1 + n], slot_starts=dev[:S + 1],
                            slot_starts_cpu=starts.tolist(), max_rows_per_slot=int(counts.max(initial=0)),
                            active_slots=dev[at + self.T:at + self.T + len(active)], row_active=dev[at:at + T])

    def static(self, size: int) -> LoRAMetadata:
        """The views a decode graph of `size` rows records: whatever build() uploads
        later is what its replays read (the grid covers all `size` rows per slot)."""
        dev = self.buffer.device
        return LoRAMetadata(sorted_rows=dev[self.S + 1:self.S + 1 + size], slot_starts=dev[:self.S + 1],
                            slot_starts_cpu=None, max_rows_per_slot=size)


def _groups(meta: LoRAMetadata):
    starts = meta.slot_starts_cpu
    for s in range(len(starts) - 1):
        if starts[s + 1] > starts[s]:
            yield s, meta.sorted_rows[starts[s]:starts[s + 1]].long()


# Small steps (decode) with several adapters run them at once on the torch path: two
# GEMMs against the slots in use instead of a few small ops per slot, which on a CPU cost
# more than the arithmetic (docs/archive/benchmarks.md §12: per slot wins below 4 adapters). Rows
# pick their own slot's part; the other slots' parts are zeros for them in the expand
# (exact: they add nothing).
DENSE_MAX_ROWS = 64
DENSE_MIN_ADAPTERS = 4


def _dense(meta: LoRAMetadata, rows: int) -> bool:
    return (meta.row_active is not None and rows <= DENSE_MAX_ROWS
            and meta.active_slots.shape[0] >= DENSE_MIN_ADAPTERS)


def shrink_torch(x: torch.Tensor, a: torch.Tensor, meta: LoRAMetadata, out: torch.Tensor) -> None:
    """out[rows of s] = x[rows of s] @ a[s]^T; a: [S, R, K]; out: [T, R] (other rows untouched)."""
    T = x.shape[0]
    if _dense(meta, T):
        _, R, K = a.shape
        used = a.index_select(0, meta.active_slots.long())                  # [A, R, K]
        every = (x @ used.reshape(-1, K).t()).view(T, -1, R)
        out.copy_(every[torch.arange(T, device=x.device), meta.row_active.long().clamp(min=0)])
        return
    for s, rows in _groups(meta):
        out.index_copy_(0, rows, x.index_select(0, rows) @ a[s].t())


def expand_torch(y: torch.Tensor, b: torch.Tensor, meta: LoRAMetadata, out: torch.Tensor,
                 scaling: torch.Tensor, scaling_cpu: list[float], slice_sizes: Optional[list[int]] = None) -> None:
    """out[rows of s] += (y[rows of s] @ b[s]^T) * scaling[s]; b: [S, N, R] (a view of an
    [N, S, R] tensor); out: [T, N] (the projection's output, or a column slice of it).
    slice_sizes: a fused projection's slices, N in all: slice i adds y's columns
    [i R, (i + 1) R) times its part of b into its columns of out."""
    R, off = b.shape[2], 0
    for i, n in enumerate(slice_sizes or [b.shape[1]]):
        _expand_slice(y[:, i * R:(i + 1) * R], b[:, off:off + n], meta, out[:, off:off + n], scaling, scaling_cpu)
        off += n


def _expand_slice(y: torch.Tensor, b: torch.Tensor, meta: LoRAMetadata, out: torch.Tensor,
                  scaling: torch.Tensor, scaling_cpu: list[float]) -> None:
    T = y.shape[0]
    if _dense(meta, T):
        _, N, R = b.shape
        active = meta.active_slots.long()
        A = active.shape[0]
        idx = meta.row_active.long()
        under = (idx >= 0)[:, None]
        idx = idx.clamp(min=0)
        # Each row's y in its own slot's columns, zeros elsewhere (no boolean indexing:
        # that would wait for the device).
        spread = y.new_zeros(T * A, R)
        spread.index_copy_(0, torch.arange(T, device=y.device) * A + idx, torch.where(under, y, 0))
        used = b.permute(1, 0, 2).index_select(1, active)                   # [N, A, R]
        delta = (spread.view(T, A * R) @ used.reshape(N, A * R).t()) * \
            torch.where(under, scaling[active][idx][:, None], 0.0).to(y.dtype)
        out.add_(delta)
        return
    for s, rows in _groups(meta):
        delta = (y.index_select(0, rows) @ b[s].t()) * scaling_cpu[s]
        out.index_copy_(0, rows, out.index_select(0, rows) + delta)


def make_lora_ops(backend: str):
    """(shrink, expand) of the torch reference or the Triton kernels."""
    if backend == "triton":
        from backend.ops import lora_triton
        return lora_triton.shrink, lora_triton.expand
    return shrink_torch, expand_torch
