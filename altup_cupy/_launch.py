"""Kernel launches with their arguments packed once: the package's one call of the driver's launch.

CuPy's `RawKernel.__call__` inspects and converts every argument on every call (several
microseconds per launch). A `PackedLaunch` fixes, once per kernel and shape, the block size, the
dynamic shared memory and the C type of every argument; a call then only stores the new values
into preallocated slots and hands their addresses to `cuLaunchKernel`. The driver copies the
argument values during the launch call, so the slots may be reused at once. Every kernel of the
package launches through it: those NVRTC builds through CuPy and the sm_90a cubins alike
(`_build.KernelSource.kernel` loads both as CuPy kernels).

Launches go to a raw CUDA stream handle (what `torch.cuda.current_stream().cuda_stream` gives),
so they are captured like any other work when that stream is capturing a CUDA graph.

A launch made `programmatic` (a programmatic dependent launch, Hopper and later) may start while
the kernel ahead of it on the stream is still running: the driver schedules its blocks as soon as
every block of that kernel has executed `griddepcontrol.launch_dependents` (or exited), and the
kernel itself must execute `griddepcontrol.wait` (common.cuh: griddep_wait) before it reads what
the kernel ahead wrote. What it saves is the gap between two kernels: the first one's tail and the
second one's launch.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from dataclasses import dataclass
from typing import Any, Sequence

# How each scalar argument type is stored (struct codes, native byte order); every argument gets
# its own slot of a multiple of 8 bytes, so each value sits at its natural alignment.
ARG_CODES = {"ptr": "Q", "i32": "i4x", "i64": "q", "f32": "f4x"}
SLOT_BYTES = 8

# The first compute capability with programmatic dependent launch (griddepcontrol, PTX ISA 7.8),
# and the first driver that records such a launch in a CUDA graph when a stream is captured (12.3;
# cuLaunchKernelEx itself came with 12.0). Older drivers get plain launches.
PROGRAMMATIC_MIN_CAPABILITY = 90
PROGRAMMATIC_MIN_DRIVER = 12030
# cuda.h: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION.
_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttributeValue(ctypes.Union):
    """cuda.h's CUlaunchAttributeValue: 64 bytes, 8-byte aligned; this attribute's member is an int."""

    _fields_ = [("programmatic_allowed", ctypes.c_int32), ("words", ctypes.c_uint64 * 8)]


class _LaunchAttribute(ctypes.Structure):
    """cuda.h's CUlaunchAttribute: a 4-byte id, padding to 8 bytes, the value."""

    _fields_ = [("id", ctypes.c_uint32), ("pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig."""

    _fields_ = [("grid_x", ctypes.c_uint32), ("grid_y", ctypes.c_uint32), ("grid_z", ctypes.c_uint32),
                ("block_x", ctypes.c_uint32), ("block_y", ctypes.c_uint32), ("block_z", ctypes.c_uint32),
                ("shared_bytes", ctypes.c_uint32), ("stream", ctypes.c_void_p),
                ("attributes", ctypes.POINTER(_LaunchAttribute)), ("attribute_count", ctypes.c_uint32)]


def _driver_launch_ex():
    """The driver's cuLaunchKernelEx, from the library CuPy has loaded."""
    function = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    function.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    function.restype = ctypes.c_int
    return function

# The devices whose primary context each thread has made current. The driver launches into the
# calling thread's current context, and a thread whose first CUDA work is one of ours has none:
# autograd's backward thread, when an altup_cupy backward is the first node it runs (torch sets
# the device through the runtime only when it differs from the thread's default, device 0).
_threads = threading.local()


def _make_context_current(device: int) -> None:
    from cupy.cuda import runtime

    runtime.setDevice(device)  # since CUDA 12: initialises the primary context, current on this thread
    _threads.__dict__.setdefault("devices", set()).add(device)


@dataclass(frozen=True)
class ByValue:
    """A struct argument passed by value: `layout` is its fields in `struct` codes, in declaration
    order and with the struct's own padding spelled out (native sizes, nothing added); a call
    gives one value per field."""

    layout: str


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return ceil_div(a, b) * b


def _slot_code(arg_type: str | ByValue) -> str:
    """The struct code of one argument's slot, padded to whole slots."""
    code = arg_type.layout if isinstance(arg_type, ByValue) else ARG_CODES[arg_type]
    padding = round_up(struct.calcsize("=" + code), SLOT_BYTES) - struct.calcsize("=" + code)
    return code + "x" * padding


class PackedLaunch:
    """One kernel at one block size and shared-memory size; grid and argument values per call.

    kernel: a CuPy RawKernel (the CUfunction of the current device is taken); arg_types: one of
    ARG_CODES' names per argument, or a `ByValue` for a struct passed by value. programmatic: launch
    it as a programmatic dependent launch where the kernel was built for a GPU that has them (its
    `ptx_version` >= 90, which the device's own build gives on Hopper) and the driver records one
    in a CUDA graph; elsewhere a plain launch. Only a kernel that waits (griddep_wait) before it
    reads its predecessor's output may be launched so."""

    def __init__(self, kernel: Any, block: int, shared_bytes: int, arg_types: Sequence[str | ByValue],
                 programmatic: bool = False):
        from cupy.cuda import driver, runtime

        self._launch_kernel = driver.launchKernel
        self._device = runtime.getDevice()  # the kernel lives in this device's primary context
        self._function = kernel.kernel.ptr  # the CUfunction of the compiled RawKernel
        self.block = int(block)
        self.shared_bytes = int(shared_bytes)
        # One struct.pack_into stores every value into the slots (one C call, not one per value);
        # the driver reads them through the array of slot addresses.
        codes = [_slot_code(t) for t in arg_types]
        self._pack = struct.Struct("=" + "".join(codes)).pack_into
        offsets = [struct.calcsize("=" + "".join(codes[:i])) for i in range(len(codes))]
        self._slots = (ctypes.c_uint64 * (struct.calcsize("=" + "".join(codes)) // SLOT_BYTES))()
        base = ctypes.addressof(self._slots)
        self._pointers = (ctypes.c_void_p * len(codes))(*(base + offset for offset in offsets))
        self._pointers_address = ctypes.addressof(self._pointers)
        # Two threads launching through one plan would overwrite each other's slots between the
        # store and the launch.
        self._lock = threading.Lock()
        self.programmatic = (programmatic and kernel.attributes["ptx_version"] >= PROGRAMMATIC_MIN_CAPABILITY
                             and runtime.driverGetVersion() >= PROGRAMMATIC_MIN_DRIVER)
        if self.programmatic:
            self._attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION,
                                               value=_LaunchAttributeValue(programmatic_allowed=1))
            self._driver_error = driver.CUDADriverError
            self._config = _LaunchConfig(block_x=self.block, block_y=1, block_z=1, grid_z=1,
                                         shared_bytes=self.shared_bytes, attributes=ctypes.pointer(self._attribute),
                                         attribute_count=1)
            self._launch_ex = _driver_launch_ex()

    def __call__(self, stream: int, grid: int | tuple[int, int], *values: Any) -> None:
        gx, gy = (grid, 1) if isinstance(grid, int) else grid
        if self._device not in getattr(_threads, "devices", ()):
            _make_context_current(self._device)
        with self._lock:
            self._pack(self._slots, 0, *values)
            if not self.programmatic:
                self._launch_kernel(self._function, gx, gy, 1, self.block, 1, 1, self.shared_bytes,
                                    stream, self._pointers_address, 0)
                return
            config = self._config
            config.grid_x, config.grid_y, config.stream = gx, gy, stream
            error = self._launch_ex(ctypes.byref(config), self._function, self._pointers_address, None)
        if error:
            raise self._driver_error(error)  # what cuLaunchKernel's wrapper raises
