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

A buffer written several times within one step (the draft model's k forwards, each with
its inputs and its sampler's parameters) takes `slots` host buffers, used in turn, all
uploading into the one device buffer (copies are ordered on the stream, so each lands
after the forward before it has read the last). With one host buffer, each write would
wait for the device to have read the previous one: for the host, a wait on everything
queued before that upload (with async scheduling, the next step's whole forward).
"""

from __future__ import annotations

import numpy as np
import torch


def _new_event(device: torch.device):
    """The event an upload records (None off CUDA, where copies are synchronous)."""
    return torch.cuda.Event() if device.type == "cuda" else None


class StagedBuffer:
    def __init__(self, size: int, dtype: torch.dtype, device: torch.device, slots: int = 1) -> None:
        pin = device.type == "cuda"
        self._hosts = [torch.zeros(size, dtype=dtype, pin_memory=pin) for _ in range(slots)]
        self._arrays: list[np.ndarray] = [h.numpy() for h in self._hosts]
        # On CPU the "device" twin is a second tensor all the same, so the upload is a
        # real copy there too (and is counted by the dispatch test like a GPU copy).
        self.device = torch.zeros(size, dtype=dtype, device=device)
        self._uploaded = [_new_event(device) for _ in range(slots)]
        self._slot = 0
        self._sent = False          # the current host buffer went up since it was written

    @property
    def host(self) -> torch.Tensor:
        """The host buffer being written, or after an upload the one that went up."""
        return self._hosts[self._slot]

    @property
    def np(self) -> np.ndarray:
        return self._arrays[self._slot]

    def writable(self) -> np.ndarray:
        """The host array to write, once its last upload has left (an event wait, not a
        device sync; immediate when that copy is done). After an upload, the next host
        buffer in turn: its last upload was `slots` uploads ago."""
        if self._sent:
            self._slot = (self._slot + 1) % len(self._hosts)
            self._sent = False
            event = self._uploaded[self._slot]
            if event is not None:
                event.synchronize()
        return self.np

    def upload(self, n: int) -> torch.Tensor:
        """Copy the first n elements to the device; returns the device view."""
        dst = self.device[:n]
        dst.copy_(self.host[:n], non_blocking=True)
        event = self._uploaded[self._slot]
        if event is not None:
            event.record()
        self._sent = True
        return dst


class GrowingStagedBuffer:
    """A StagedBuffer for payloads whose size varies per step (penalty token lists):
    it grows by doubling, so after warm-up no step allocates pinned memory."""

    def __init__(self, dtype: torch.dtype, device: torch.device, size: int = 1024, slots: int = 1) -> None:
        self.dtype, self.device, self.slots = dtype, device, slots
        self._buf = StagedBuffer(size, dtype, device, slots)

    def upload(self, values: np.ndarray) -> torch.Tensor:
        n = int(values.shape[0])
        if n > self._buf.np.shape[0]:
            self._buf = StagedBuffer(max(n, 2 * self._buf.np.shape[0]), self.dtype, self.device, self.slots)
        self._buf.writable()[:n] = values
        return self._buf.upload(n)
