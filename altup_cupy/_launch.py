"""Kernel launches with their arguments packed once.

CuPy's `RawKernel.__call__` inspects and converts every argument on every call (several
microseconds per launch). A `PackedLaunch` fixes, once per kernel and shape, the block size, the
dynamic shared memory and the C type of every argument; a call then only stores the new values
into preallocated ctypes slots and hands their addresses to `cuLaunchKernel`. The driver copies the
argument values during the launch call, so the slots may be reused at once.

Launches go to a raw CUDA stream handle (what `torch.cuda.current_stream().cuda_stream` gives),
so they are captured like any other work when that stream is capturing a CUDA graph.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Sequence

# The C types a kernel argument can have, by the names the launch plans use.
ARG_TYPES = {
    "ptr": ctypes.c_uint64,
    "i32": ctypes.c_int32,
    "i64": ctypes.c_int64,
    "f32": ctypes.c_float,
}


class PackedLaunch:
    """One kernel at one block size and shared-memory size; grid and argument values per call."""

    def __init__(self, kernel: Any, block: int, shared_bytes: int, arg_types: Sequence[str]):
        from cupy.cuda import driver

        self._launch_kernel = driver.launchKernel
        self._function = kernel.kernel.ptr  # the CUfunction of the compiled RawKernel
        self.block = int(block)
        self.shared_bytes = int(shared_bytes)
        self._slots = [ARG_TYPES[t]() for t in arg_types]
        self._pointers = (ctypes.c_void_p * len(self._slots))(
            *(ctypes.addressof(slot) for slot in self._slots))
        self._pointers_address = ctypes.addressof(self._pointers)
        # Two threads launching through one plan would overwrite each other's slots between the
        # store and the launch.
        self._lock = threading.Lock()

    def __call__(self, stream: int, grid: int | tuple[int, int], *values: Any) -> None:
        gx, gy = (grid, 1) if isinstance(grid, int) else grid
        with self._lock:
            for slot, value in zip(self._slots, values, strict=True):
                slot.value = value
            self._launch_kernel(self._function, gx, gy, 1, self.block, 1, 1, self.shared_bytes,
                                stream, self._pointers_address, 0)
