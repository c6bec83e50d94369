"""The no-GPU message (altup_cupy._device.gpu_status) says what was found: no driver, no device, a
driver too old for CuPy or torch, CuPy missing, a CPU build of torch. Each case is simulated on
the CPU: the driver probe and CuPy are replaced by stand-ins."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from altup_cupy import _device


class _RuntimeError(Exception):
    """Like cupy.cuda.runtime.CUDARuntimeError: the cudaError_t in `status`."""

    def __init__(self, status: int):
        super().__init__(f"cudaError {status}")
        self.status = status


def _fake_cupy(count=None, status=None, runtime=13000):
    def get_device_count():
        if status is not None:
            raise _RuntimeError(status)
        return count

    runtime_api = types.SimpleNamespace(getDeviceCount=get_device_count, runtimeGetVersion=lambda: runtime)
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime_api))


@pytest.fixture
def found(monkeypatch):
    """found(driver=..., cupy=..., torch_cuda=..., torch_sees=...): the machine gpu_status sees."""

    def set_up(driver, cupy=None, torch_cuda="13.0", torch_sees=False):
        monkeypatch.setattr(_device, "driver_cuda_version", lambda: driver)
        monkeypatch.setitem(sys.modules, "cupy", cupy)  # None: import cupy -> ModuleNotFoundError
        monkeypatch.setattr(torch.version, "cuda", torch_cuda)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: torch_sees)
        return _device.gpu_status()

    return set_up


def test_no_driver(found):
    assert found(driver=None) == (False, "no NVIDIA driver is installed (libcuda.so.1 cannot be loaded)")


def test_cupy_missing_names_the_gpu_extra(found):
    usable, why = found(driver=13000)
    assert not usable and why.startswith("CuPy is not installed; it comes with the 'gpu' extra: pip install")


@pytest.mark.parametrize("cupy", [_fake_cupy(status=_device.CUDA_ERROR_NO_DEVICE), _fake_cupy(count=0)])
def test_driver_but_no_device(found, cupy):
    assert found(driver=13000, cupy=cupy) == (
        False, "an NVIDIA driver (CUDA 13.0) is installed, but no CUDA device is visible")


def test_driver_too_old_for_cupy(found):
    usable, why = found(driver=12080, cupy=_fake_cupy(status=_device.CUDA_ERROR_INSUFFICIENT_DRIVER))
    assert not usable
    assert why.startswith("the NVIDIA driver is too old for this CuPy: it supports CUDA up to 12.8, CuPy is built "
                          "for CUDA 13.0; update the driver, or install cupy-cuda12x")


def test_other_cuda_errors_are_passed_on(found):
    usable, why = found(driver=13000, cupy=_fake_cupy(status=999))
    assert not usable and why == "CuPy cannot reach a CUDA GPU (_RuntimeError: cudaError 999)"


def test_cpu_build_of_torch(found):
    usable, why = found(driver=13000, cupy=_fake_cupy(count=1), torch_cuda=None)
    assert not usable and why.startswith("this torch is a CPU-only build")


def test_driver_too_old_for_torch(found):
    usable, why = found(driver=12080, cupy=_fake_cupy(count=1), torch_cuda="13.0")
    assert not usable
    assert why.startswith("the NVIDIA driver is too old for this torch: it supports CUDA up to 12.8, torch")


def test_torch_of_the_drivers_major_release_that_sees_no_device(found):
    usable, why = found(driver=12020, cupy=_fake_cupy(count=1), torch_cuda="12.6")
    assert not usable and why.endswith("(built for CUDA 12.6) sees no CUDA device")


def test_usable(found):
    assert found(driver=13000, cupy=_fake_cupy(count=1), torch_sees=True) == (True, "")


def test_the_driver_probe_answers_without_a_device():
    version = _device.driver_cuda_version()
    assert version is None or version >= 1000
