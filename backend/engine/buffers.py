"""Host staging buffers with a device twin, allocated once.

A step's inputs are written on the host with numpy into a pinned buffer and sent to the
device with one asynchronous copy (vLLM's CpuGpuBuffer idea). Pinned memory is what
makes `non_blocking=True` truly asynchronous: a copy from pageable memory makes CUDA wait
for the stream first, a host sync. The device side has a fixed address, which is what a
captured CUDA graph reads.

The staging buffer may be rewritten only after the previous copy from it has finished:
writers call `writable()` first, which waits on an event recorded after the last upload
(done long before in practice: the step's sampled-id copy waited for it; a step of
mid-prompt chunks samples nothing, and there the event is what keeps the next step from
overwriting an upload still in flight).
"""

from __future__ import annotations

import numpy as np
import torch


class StagedBuffer:
    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.host = torch.zeros(size, dtype=dtype, pin_memory=pin)
        self.np: np.ndarray = self.host.numpy()
        # On CPU the "device" twin is a second tensor all the same, so the upload is a
        # real copy there too (and is counted by the dispatch test like a GPU copy).
        self.device = torch.zeros(size, dtype=dtype, device=device)
        self._uploaded = torch.cuda.Event() if pin else None

    def writable(self) -> np.ndarray:
        """The host array, once the last upload from it has left (an event wait, not a
        device sync; immediate when the copy is done)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
        return self.np

    def upload(self, n: int) -> torch.Tensor:
        """Copy the first n elements to the device; returns the device view."""
        dst = self.device[:n]
        dst.copy_(self.host[:n], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()
        return dst


class GrowingStagedBuffer:
    """A StagedBuffer for payloads whose size varies per step (penalty token lists):
    it grows by doubling, so after warm-up no step allocates pinned memory."""

    def __init__(self, dtype: torch.dtype, device: torch.device, size: int = 1024) -> None:
        self.dtype, self.device = dtype, device
        self._buf = StagedBuffer(size, dtype, device)

    def upload(self, values: np.ndarray) -> torch.Tensor:
        n = int(values.shape[0])
        if n > self._buf.np.shape[0]:
            self._buf = StagedBuffer(max(n, 2 * self._buf.np.shape[0]), self.dtype, self.device)
        self._buf.writable()[:n] = values
        return self._buf.upload(n)
