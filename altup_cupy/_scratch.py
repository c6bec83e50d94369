"""Scratch memory that launch plans reuse from call to call, one buffer per (device, stream).

Work on one stream runs in order, so a buffer that only that stream's launches touch can serve
every call without a new allocation (an allocation through torch's caching allocator costs the
host a few microseconds). Only the ops' eager fast path reuses buffers: under CUDA-graph capture
a call takes a fresh buffer (the graph owns it, and a replay may run on any stream beside eager
calls), and so does every call through torch's dispatcher (torch.compile's CUDA-graph trees
allocate even their warm-up runs from the graph's pool, and refuse a buffer that outlives the
call there). Buffers larger than `MAX_CACHED_BYTES` are never kept (a large scratch should go
back to the caching allocator's pool for other uses).
"""

from __future__ import annotations

import torch

MAX_CACHED_BYTES = 64 << 20


class StreamScratch:
    """Byte buffers per (device, stream). zeroed: buffers start as zeros (the kernels that use
    them must leave them zero again, as arrival counters do)."""

    def __init__(self, zeroed: bool = False):
        self._new = torch.zeros if zeroed else torch.empty
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}

    def get(self, nbytes: int, device: torch.device, stream: int, reuse: bool = True) -> torch.Tensor:
        """A uint8 buffer of at least `nbytes` on `device` for launches on `stream` (the current
        stream); reuse False: always a fresh one."""
        if not reuse or nbytes > MAX_CACHED_BYTES or torch.cuda.is_current_stream_capturing():
            return self._new(nbytes, dtype=torch.uint8, device=device)
        key = (device.index, stream)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < nbytes:
            # Allocated on `stream`, the current one: the old buffer goes back to the caching
            # allocator, which hands it out again only after this stream's earlier work.
            buffer = self._buffers[key] = self._new(nbytes, dtype=torch.uint8, device=device)
        return buffer
