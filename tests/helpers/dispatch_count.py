"""Count what one engine step would cost a GPU, on CPU: kernel dispatches (aten ops and
Triton launches), host-to-device copies, and host syncs.

- aten ops are seen through a TorchDispatchMode. Views and allocations are free on a GPU
  and are not counted; everything else would be a kernel launch (or a copy).
- Triton launches are counted at the interpreter's launch (one each); what the
  interpreter does inside a launch (copying arguments around) is not counted.
- Host syncs: aten ops that read a device value on the host (`_local_scalar_dense`
  behind .item()/bool(), ops with data-dependent output shapes) and the Python-level
  Tensor.tolist/.numpy/.cpu calls, which on a GPU copy to the host and wait.
- Tensors made from Python data inside the step (torch.tensor, as_tensor, from_numpy)
  are counted as a dispatch each: on a GPU they would be a host-to-device copy.

Dispatches are attributed to "layers" while a decoder layer's forward runs and to
"outside" otherwise.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
FREE = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
        aten.new_empty_strided.default, aten.lift_fresh.default, aten.detach.default}
SYNCS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default, aten.is_nonzero.default,
         aten.equal.default, aten._unique2.default, aten.unique_consecutive.default}


def _bool_mask_index(func, args) -> bool:
    """x[mask] / x[mask] = v: the output size depends on the mask (nonzero inside)."""
    if func not in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))


@dataclass
class StepCounts:
    layers: Counter = field(default_factory=Counter)
    outside: Counter = field(default_factory=Counter)
    syncs: Counter = field(default_factory=Counter)
    in_layer: int = 0
    paused: int = 0

    def add(self, name: str) -> None:
        if not self.paused:
            (self.layers if self.in_layer else self.outside)[name] += 1

    def sync(self, name: str) -> None:
        if not self.paused:
            self.syncs[name] += 1

    @property
    def num_layer_dispatches(self) -> int:
        return sum(self.layers.values())

    @property
    def num_outside_dispatches(self) -> int:
        return sum(self.outside.values())

    @property
    def num_syncs(self) -> int:
        return sum(self.syncs.values())


class _Mode(TorchDispatchMode):
    def __init__(self, counts: StepCounts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCS or _bool_mask_index(func, args):
            self.counts.sync(str(func))
        elif func not in FREE and not func.is_view:
            self.counts.add(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_dispatches(model=None):
    """Counts inside the block; `model` (a CausalLM) enables the per-layer split."""
    from triton.runtime.interpreter import GridExecutor
    counts = StepCounts()
    patches = []

    def patch(owner, name, wrap):
        orig = getattr(owner, name)
        setattr(owner, name, wrap(orig))
        patches.append((owner, name, orig))

    def launch(orig):
        def run(self, *args, **kwargs):
            counts.add(f"triton:{getattr(self.fn, '__name__', self.fn)}")
            counts.paused += 1
            try:
                return orig(self, *args, **kwargs)
            finally:
                counts.paused -= 1
        return run

    def host_read(name):
        def wrap(orig):
            def call(*args, **kwargs):
                counts.sync(f"Tensor.{name}")
                counts.paused += 1
                try:
                    return orig(*args, **kwargs)
                finally:
                    counts.paused -= 1
            return call
        return wrap

    def from_host(name):
        def wrap(orig):
            def call(*args, **kwargs):
                counts.add(f"torch.{name}")
                return orig(*args, **kwargs)
            return call
        return wrap

    patch(GridExecutor, "__call__", launch)
    for name in ("tolist", "numpy", "cpu"):
        patch(torch.Tensor, name, host_read(name))
    for name in ("tensor", "as_tensor", "from_numpy"):
        patch(torch, name, from_host(name))
    hooks = []
    if model is not None:
        def enter(*_):
            counts.in_layer += 1

        def leave(*_):
            counts.in_layer -= 1
        for layer in model.model.layers:
            hooks += [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
    try:
        with _Mode(counts):
            yield counts
    finally:
        for h in hooks:
            h.remove()
        for owner, name, orig in reversed(patches):
            setattr(owner, name, orig)
