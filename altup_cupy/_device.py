"""The GPU this process runs on: whether the kernels can run here, and its compute capability."""

from __future__ import annotations

import functools

MIN_COMPUTE_CAPABILITY = 80  # Ampere (8.0): cp.async, bf16 conversions, 16-byte streaming loads


def gpu_status() -> tuple[bool, str]:
    """(usable, why not): the kernels need CuPy and torch both seeing a CUDA device (torch for the
    benchmark's baselines, references and timing)."""
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # ImportError, or a CUDA runtime error without a driver
        return False, f"CuPy cannot reach a CUDA GPU ({type(error).__name__}: {error})"
    if count == 0:
        return False, "CuPy sees no CUDA device"
    import torch

    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    return True, ""


@functools.lru_cache(maxsize=None)
def compute_capability(device_index: int) -> int:
    """The compute capability of CUDA device `device_index` as an int: 90 for 9.0, 86 for 8.6."""
    import cupy

    return int(cupy.cuda.Device(device_index).compute_capability)


def device_name(device_index: int) -> str:
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(device_index)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def check_supported(device_index: int) -> int:
    """The compute capability of `device_index`; RuntimeError naming the device if it is older
    than 8.0, which no kernel of this package supports."""
    capability = compute_capability(device_index)
    if capability < MIN_COMPUTE_CAPABILITY:
        raise RuntimeError(
            f"CUDA device {device_index} ({device_name(device_index)}) has compute capability "
            f"{capability // 10}.{capability % 10}; altup_cupy's kernels need 8.0 or newer "
            f"(Ampere, Ada, Hopper or later)")
    return capability
