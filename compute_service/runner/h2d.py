"""One host-to-device copy per step for the step's metadata, from pinned memory.

Why: a copy from pageable host memory has to be staged by the driver and, in practice, waits for
the stream to drain; with async scheduling that made the host wait for step N to finish before it
could launch step N+1. Packing every small array into a pinned buffer and sending it with one
`copy_(non_blocking=True)` keeps the host ahead of the device and costs one copy launch, not six.

A ring of pinned buffers (each guarded by an event recorded after its copy) lets the host fill
step N+1's buffer while step N's copy may still be queued. The device side is a matching ring of
byte buffers; arrays come back as typed views into it (offsets aligned to 8 bytes).
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 8
_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


class PinnedUploader:
    def __init__(self, device: torch.device, ring: int = 3):
        self.device = device
        self.ring = ring
        self._host: list[torch.Tensor] = []
        self._dev: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = []
        self._i = 0

    def _grow(self, nbytes: int) -> None:
        size = max(nbytes, 1 << 16) * 2
        self._host = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(self.ring)]
        self._dev = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(self.ring)]
        self._events = [None] * self.ring

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Contiguous int32/int64 numpy arrays -> device tensors of the same dtype and shape."""
        if self.device.type != "cuda":  # CPU: no copy at all (tensors share the arrays' memory)
            return [torch.from_numpy(a) for a in arrays]
        offs, total = [], 0
        for a in arrays:
            offs.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        if not self._host or self._host[0].numel() < total:
            self._grow(total)
        i = self._i
        self._i = (i + 1) % self.ring
        ev = self._events[i]
        if ev is not None:
            ev.synchronize()  # the copy that last read this pinned buffer (normally long done)
        host = self._host[i].numpy()
        for a, o in zip(arrays, offs):
            host[o:o + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        dev = self._dev[i]
        dev[:total].copy_(self._host[i][:total], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._events[i] = ev
        return [dev[o:o + a.nbytes].view(_TORCH[a.dtype]).view(a.shape) for a, o in zip(arrays, offs)]
