"""Whether this machine can run the kernels: the one check the CLI and the notebooks share."""

from __future__ import annotations


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
