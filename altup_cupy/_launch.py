"""Kernel launches with their arguments packed once.

CuPy's `RawKernel.__call__` inspects and converts every argument on every call (several
microseconds per launch). A `PackedLaunch` fixes, once per kernel and shape, the block size, the
dynamic shared memory and the C type of every argument; a call then only stores the new values
into preallocated slots and hands their addresses to `cuLaunchKernel`. The driver copies the
argument values during the launch call, so the slots may be reused at once.

Launches go to a raw CUDA stream handle (what `torch.cuda.current_stream().cuda_stream` gives),
so they are captured like any other work when that stream is capturing a CUDA graph.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from typing import Any, Sequence

# How each argument type is stored (struct codes, native byte order); every argument gets its own
# 8-byte slot, so each value sits at its natural alignment.
ARG_CODES = {"ptr": "Q", "i32": "i4x", "i64": "q", "f32": "f4x"}
SLOT_BYTES = 8


class PackedLaunch:
    """One kernel at one block size and shared-memory size; grid and argument values per call."""

    def __init__(self, kernel: Any, block: int, shared_bytes: int, arg_types: Sequence[str]):
        from cupy.cuda import driver

        self._launch_kernel = driver.launchKernel
        self._function = kernel.kernel.ptr  # the CUfunction of the compiled RawKernel
        self.block = int(block)
        self.shared_bytes = int(shared_bytes)
        # One struct.pack_into stores every value into the slots (one C call, not one per value);
        # the driver reads them through the array of slot addresses.
        self._pack = struct.Struct("=" + "".join(ARG_CODES[t] for t in arg_types)).pack_into
        self._slots = (ctypes.c_uint64 * len(arg_types))()
        base = ctypes.addressof(self._slots)
        self._pointers = (ctypes.c_void_p * len(arg_types))(
            *(base + SLOT_BYTES * i for i in range(len(arg_types))))
        self._pointers_address = ctypes.addressof(self._pointers)
        # Two threads launching through one plan would overwrite each other's slots between the
        # store and the launch.
        self._lock = threading.Lock()

    def __call__(self, stream: int, grid: int | tuple[int, int], *values: Any) -> None:
        gx, gy = (grid, 1) if isinstance(grid, int) else grid
        with self._lock:
            self._pack(self._slots, 0, *values)
            self._launch_kernel(self._function, gx, gy, 1, self.block, 1, 1, self.shared_bytes,
                                stream, self._pointers_address, 0)
