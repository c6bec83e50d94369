"""What the host needs to know of a CUDA device, asked once per device."""

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
    """(compute capability as 10 * major + minor, device name); a named error below 8.0."""
    major, minor = torch.cuda.get_device_capability(index)
    name = torch.cuda.get_device_name(index)
    capability = 10 * major + minor
    if capability < MIN_COMPUTE_CAPABILITY:
        raise RuntimeError(
            f"altup_cupy needs a GPU of compute capability {MIN_COMPUTE_CAPABILITY / 10:.1f} or newer; "
            f"cuda:{index} ({name}) has {major}.{minor}")
    return capability, name


def on(device: torch.device):
    """Make `device` current for the duration, if it is not already (a launch goes to the
    current device's context)."""
    if device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)
