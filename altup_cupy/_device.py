"""What the host needs to know of a CUDA device: asked once per device, through torch."""

from __future__ import annotations

import contextlib
import functools

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


def check_supported(index: int) -> int:
    """The compute capability of device `index` (90 for 9.0), or the named error of `facts`."""
    return facts(index)[0]


def on(device: torch.device):
    """Make `device` current for the duration, if it is not already (a launch goes to the
    current device's context)."""
    if device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)
