"""Scratch memory that launch plans reuse from call to call, one buffer per (device, stream).

Work on one stream runs in order, so a buffer that only that stream's launches touch can serve
every call without a new allocation (an allocation through torch's caching allocator costs the
host a few microseconds). A call takes the buffer for itself and hands it back once its last
launch using it is queued: two threads issuing work to one stream (torch's default stream is
every thread's) could otherwise queue one call's launches between the other's, both on the same
memory. A call that finds the buffer taken gets a fresh one.

Only the ops' eager fast path reuses buffers: under CUDA-graph capture a call takes a fresh buffer
(the graph owns it, and a replay may run on any stream beside eager calls), and so does every call
through torch's dispatcher (torch.compile's CUDA-graph trees allocate even their warm-up runs from
the graph's pool, and refuse a buffer that outlives the call there). Buffers larger than
`MAX_CACHED_BYTES` are never kept (a large scratch should go back to the caching allocator's pool
for other uses); the kept ones live as long as the process.
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

    def take(self, nbytes: int, device: torch.device, stream: int,
             reuse: bool = True) -> tuple[torch.Tensor, tuple[int, int] | None]:
        """(a uint8 buffer of at least `nbytes` on `device` for launches on `stream`, the current
        stream; the key to hand it back under, or None for a buffer that is not to be kept).
        reuse False: always a fresh buffer, not kept."""
        if not reuse or nbytes > MAX_CACHED_BYTES or torch.cuda.is_current_stream_capturing():
            return self._new(nbytes, dtype=torch.uint8, device=device), None
        key = (device.index, stream)
        # pop is atomic under the GIL: a concurrent caller on this stream finds nothing and allocates.
        buffer = self._buffers.pop(key, None)
        if buffer is None or buffer.numel() < nbytes:
            # Allocated on `stream`, the current one: a smaller buffer dropped here goes back to
            # the caching allocator, which hands it out again only after this stream's earlier work.
            buffer = self._new(nbytes, dtype=torch.uint8, device=device)
        return buffer, key

    def give_back(self, buffer: torch.Tensor, key: tuple[int, int] | None) -> None:
        """Keep `buffer` for the next call on its stream (after the call's last launch that uses it
        is queued); a key of None (a buffer not to be kept) does nothing."""
        if key is not None:
            self._buffers[key] = buffer
