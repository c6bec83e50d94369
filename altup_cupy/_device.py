"""What the host needs to know of a CUDA device: asked once per device, through torch."""

from __future__ import annotations

import contextlib
import functools
import os

import torch

MIN_COMPUTE_CAPABILITY = 80  # Ampere (8.0): cp.async, bf16 conversions, 16-byte streaming loads


def gpu_status() -> tuple[bool, str]:
    """(usable, why not): the kernels need CuPy and torch both seeing a CUDA device."""
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # ImportError, or a CUDA runtime error without a driver
        return False, f"CuPy cannot reach a CUDA GPU ({type(error).__name__}: {error})"
    if count == 0:
        return False, "CuPy sees no CUDA device"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
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


def check_supported(index: int) -> int:
    """The compute capability of device `index` (90 for 9.0), or the named error of `facts`."""
    return facts(index)[0]


def on(device: torch.device):
    """Make `device` current for the duration, if it is not already (a launch goes to the
    current device's context)."""
    if device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)
