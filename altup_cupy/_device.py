"""What the host needs to know of a CUDA device: asked once per device, through torch."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os

import torch

from ._extras import missing

MIN_COMPUTE_CAPABILITY = 80  # Ampere (8.0): cp.async, bf16 conversions, 16-byte streaming loads


# The CUDA runtime's error codes that say what is missing (cudaError_t).
CUDA_ERROR_INSUFFICIENT_DRIVER = 35
CUDA_ERROR_NO_DEVICE = 100


def _cuda_version(number: int) -> str:
    """12080 -> '12.8'."""
    return f"{number // 1000}.{number % 1000 // 10}"


def driver_cuda_version() -> int | None:
    """The CUDA version the installed NVIDIA driver supports (13000 for 13.0), or None where no
    driver library (libcuda.so.1) can be loaded. Needs no device and initialises nothing."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return version.value


def gpu_status() -> tuple[bool, str]:
    """(usable, why not, in plain words): the kernels need an NVIDIA driver, a CUDA device, CuPy
    built for a CUDA the driver supports, and a CUDA build of torch."""
    driver = driver_cuda_version()
    if driver is None:
        return False, "no NVIDIA driver is installed (libcuda.so.1 cannot be loaded)"
    try:
        import cupy
    except ModuleNotFoundError:
        return False, str(missing("CuPy", "gpu"))
    except ImportError as error:  # installed, but its own libraries do not load
        return False, f"CuPy is installed but cannot be imported ({error})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # cupy.cuda.runtime.CUDARuntimeError: its status says what is missing
        status = getattr(error, "status", None)
        if status == CUDA_ERROR_NO_DEVICE:
            count = 0
        elif status == CUDA_ERROR_INSUFFICIENT_DRIVER:
            runtime = cupy.cuda.runtime.runtimeGetVersion()
            return False, (f"the NVIDIA driver is too old for this CuPy: it supports CUDA up to {_cuda_version(driver)}, "
                           f"CuPy is built for CUDA {_cuda_version(runtime)}; update the driver, or install "
                           f"cupy-cuda{driver // 1000}x (README, \"Install\")")
        else:
            return False, f"CuPy cannot reach a CUDA GPU ({type(error).__name__}: {error})"
    if count == 0:
        return False, f"an NVIDIA driver (CUDA {_cuda_version(driver)}) is installed, but no CUDA device is visible"
    if not torch.cuda.is_available():
        built_for = torch.version.cuda
        if built_for is None:
            return False, f"this torch is a CPU-only build ({torch.__version__}); install a CUDA build (README, \"Install\")"
        if driver // 1000 < int(built_for.split(".")[0]):  # within a major release, minor versions are compatible
            return False, (f"the NVIDIA driver is too old for this torch: it supports CUDA up to "
                           f"{_cuda_version(driver)}, torch {torch.__version__} is built for CUDA {built_for}")
        return False, f"torch {torch.__version__} (built for CUDA {built_for}) sees no CUDA device"
    return True, ""


@functools.lru_cache(maxsize=None)
def facts(index: int) -> tuple[int, str]:
    """(compute capability as 10 * major + minor, device name); a RuntimeError naming the device
    below 8.0, which no kernel of this package supports."""
    major, minor = torch.cuda.get_device_capability(index)
    name = torch.cuda.get_device_name(index)
    if 10 * major + minor < MIN_COMPUTE_CAPABILITY:
        raise RuntimeError(
            f"CUDA device {index} ({name}) has compute capability {major}.{minor}; altup_cupy's "
            "kernels need 8.0 or newer (Ampere, Ada, Hopper or later)")
    return 10 * major + minor, name


# Set to a compute capability (e.g. 80) to have the default version chosen as on a GPU of at most
# that capability: what an A100 would run, checked on a newer GPU. Explicitly requested versions
# and the kernels' compile target still follow the GPU at hand. Read when a shape's version is
# first picked (the choice is cached per shape), so set it before the first call.
DISPATCH_CAP_VARIABLE = "ALTUP_MAX_COMPUTE_CAPABILITY"


def default_dispatch_capability(capability: int) -> int:
    """The compute capability that picks the default version: the device's, or less where
    ALTUP_MAX_COMPUTE_CAPABILITY says so."""
    value = os.environ.get(DISPATCH_CAP_VARIABLE, "").strip()
    if not value:
        return capability
    if not value.isdigit() or int(value) < MIN_COMPUTE_CAPABILITY:
        raise ValueError(f"{DISPATCH_CAP_VARIABLE} must be a compute capability written as an integer "
                         f">= {MIN_COMPUTE_CAPABILITY} (e.g. 80 for 8.0), got {value!r}")
    return min(capability, int(value))


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    """The number of SMs of device `index` (launch grids are sized by it on every call)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def shared_memory_per_sm(index: int) -> int:
    """Bytes of shared memory one SM of device `index` offers its resident blocks together."""
    from cupy.cuda import runtime

    return runtime.getDeviceProperties(index)["sharedMemPerMultiprocessor"]


def check_supported(index: int) -> int:
    """The compute capability of device `index` (90 for 9.0), or the named error of `facts`."""
    return facts(index)[0]


def on(device: torch.device | int):
    """Make `device` (a CUDA device or its index) current for the duration, if it is not already
    (a launch goes to the current device's context)."""
    index = device if isinstance(device, int) else device.index
    # torch._C._cuda_getDevice: torch.cuda.current_device without its Python-level lazy-init call
    # (the C++ call initialises lazily itself); it runs on every call of every op
    if index == torch._C._cuda_getDevice():
        return contextlib.nullcontext()
    return torch.cuda.device(index)
