"""What `_launch.PackedLaunch` hands the driver, on the CPU: the driver's launch call is replaced
by one that reads the argument slots the way cuLaunchKernel does (each kernel parameter's bytes at
the address the parameter array holds for it)."""

from __future__ import annotations

import ctypes
import struct
import sys
import types

import pytest

from altup_cupy import _launch
from altup_cupy._launch import ByValue, PackedLaunch, ceil_div, round_up
from altup_cupy.ops import collapse_hopper


@pytest.fixture
def driver_calls(monkeypatch):
    """The launches made while the fixture is active: (function, grid, block, shared bytes,
    stream, [each parameter's first `sizes[i]` bytes]), read during the call."""
    calls, sizes = [], []

    def launch_kernel(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        pointers = (ctypes.c_void_p * len(sizes)).from_address(params)
        values = [ctypes.string_at(pointers[i], size) for i, size in enumerate(sizes)]
        calls.append((function, (gx, gy, gz), (bx, by, bz), shared, stream, values))

    cupy, cuda, driver, runtime = (types.ModuleType(n) for n in ("cupy", "cupy.cuda", "cupy.cuda.driver",
                                                                  "cupy.cuda.runtime"))
    driver.launchKernel, cuda.driver, cuda.runtime, cupy.cuda = launch_kernel, driver, runtime, cuda
    runtime.getDevice, runtime.setDevice = (lambda: 0), context_calls.append
    runtime.driverGetVersion = lambda: driver_version["version"]
    driver.CUDADriverError = DriverError
    for name, module in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.driver", driver),
                         ("cupy.cuda.runtime", runtime)):
        monkeypatch.setitem(sys.modules, name, module)
    return calls, sizes


context_calls: list[int] = []  # the devices made current through the runtime, in order
driver_version = {"version": 13000}  # what the fake runtime's driverGetVersion returns


class DriverError(Exception):
    """Stands for cupy.cuda.driver.CUDADriverError (built from a CUresult)."""


def _kernel(function: int):
    """What PackedLaunch reads of a CuPy RawKernel: its CUfunction on the current device."""
    return types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=function))


def test_scalars_each_in_their_own_slot(driver_calls):
    calls, sizes = driver_calls
    sizes += [8, 4, 8, 4]
    launch = PackedLaunch(_kernel(0xF00), 256, 1024, ("ptr", "i32", "i64", "f32"))
    launch(0x5EED, (7, 3), 0x7F0000001000, -5, 1 << 40, 0.25)
    launch(0x5EED, 9, 0x10, 6, 7, 8.0)  # the slots serve the next call at once
    (function, grid, block, shared, stream, values), second = calls
    assert (function, grid, block, shared, stream) == (0xF00, (7, 3, 1), (256, 1, 1), 1024, 0x5EED)
    assert values == [struct.pack("=Q", 0x7F0000001000), struct.pack("=i", -5), struct.pack("=q", 1 << 40),
                      struct.pack("=f", 0.25)]
    assert second[1] == (9, 1, 1) and second[5][1] == struct.pack("=i", 6)


def test_a_struct_by_value_is_one_parameter_of_its_fields(driver_calls):
    calls, sizes = driver_calls
    sizes += [4, 24, 8]
    # struct { char name[8]; int count; /* 4 bytes of padding */ unsigned long long address; }
    launch = PackedLaunch(_kernel(1), 32, 0, ("i32", ByValue("8si4xQ"), "ptr"))
    launch(0, 1, 3, b"abc", -1, 0xABC, 0xDEF)
    values = calls[0][5]
    assert values == [struct.pack("=i", 3), b"abc" + bytes(5) + struct.pack("=i4xQ", -1, 0xABC),
                      struct.pack("=Q", 0xDEF)]


def test_the_collapse_gemm_parameters_reach_the_kernel_as_declared(driver_calls):
    """The Hopper GEMM's one parameter: CollapseGemmParams' bytes, the x and w map slots padded
    with zeros for N < 4, every field at the offset tests/test_collapse_hopper.py checks."""
    calls, sizes = driver_calls
    sizes.append(collapse_hopper.PARAMS_BYTES)
    launch = PackedLaunch(_kernel(2), collapse_hopper.THREADS, collapse_hopper.SHARED_BYTES,
                          (collapse_hopper.PARAMS,))
    fields = (b"x" * 256, b"w" * 256, 1, 2, 613, 2056, 2, 5, 9, 33, 1, 33, 90)
    launch(0, 132, *fields)
    (params,) = calls[0][5]
    assert params == struct.pack("=" + collapse_hopper.PARAMS.layout, *fields)
    assert params[256:384] == bytes(128) and params[640:768] == bytes(128)


def test_ceil_div_and_round_up():
    assert [ceil_div(a, 4) for a in (0, 1, 4, 5)] == [0, 1, 1, 2]
    assert [round_up(a, 32) for a in (1, 32, 33)] == [32, 32, 64]


def test_each_thread_makes_the_context_current_once(driver_calls):
    """A thread whose first CUDA work is a launch of ours (autograd's backward thread) has no
    current context: the first launch of each thread makes the kernel's device current."""
    import threading

    calls, sizes = driver_calls
    sizes += [4]
    launch = PackedLaunch(_kernel(1), 32, 0, ("i32",))
    context_calls.clear()
    _launch._threads.__dict__.clear()  # this thread as if it had launched nothing yet
    launch(0, 1, 1)
    launch(0, 1, 2)
    worker = threading.Thread(target=lambda: (launch(0, 1, 3), launch(0, 1, 4)))
    worker.start()
    worker.join()
    assert len(calls) == 4
    assert context_calls == [0, 0]  # once in this thread, once in the worker


def test_launch_config_structs_have_cuda_h_layout():
    """cuLaunchKernelEx reads these structs by cuda.h's layout (64-bit): CUlaunchAttribute is an id
    padded to 8 bytes and a 64-byte value union; CUlaunchConfig seven unsigned ints, the stream,
    the attribute pointer and their count."""
    assert ctypes.sizeof(_launch._LaunchAttribute) == 72 and ctypes.alignment(_launch._LaunchAttribute) == 8
    assert _launch._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(_launch._LaunchAttributeValue) == 64
    assert ctypes.sizeof(_launch._LaunchConfig) == 56
    assert [getattr(_launch._LaunchConfig, f).offset for f in ("shared_bytes", "stream", "attributes",
                                                               "attribute_count")] == [24, 32, 40, 48]


def _programmatic_kernel(function: int, ptx_version: int):
    kernel = _kernel(function)
    kernel.attributes = {"ptx_version": ptx_version}
    return kernel


def test_a_programmatic_launch_goes_through_launch_kernel_ex(driver_calls, monkeypatch):
    """On a kernel built for sm_90: cuLaunchKernelEx with the programmatic-serialization attribute,
    the call's grid and stream, the block and shared bytes of the plan, the packed arguments; a
    driver error is raised, not dropped."""
    calls, sizes = driver_calls
    sizes += [8, 4]
    ex_calls, results = [], [0, 700]

    def launch_ex(config, function, params, extra):
        c = config._obj
        pointers = (ctypes.c_void_p * len(sizes)).from_address(params)
        values = [ctypes.string_at(pointers[i], size) for i, size in enumerate(sizes)]
        attribute = c.attributes[0]
        ex_calls.append(((c.grid_x, c.grid_y, c.grid_z), (c.block_x, c.block_y, c.block_z), c.shared_bytes,
                         c.stream, c.attribute_count, attribute.id, attribute.value.programmatic_allowed, function,
                         values, extra))
        return results.pop(0)

    monkeypatch.setattr(_launch, "_driver_launch_ex", lambda: launch_ex)
    launch = PackedLaunch(_programmatic_kernel(0xAB, 90), 1024, 64, ("ptr", "i32"), programmatic=True)
    assert launch.programmatic
    launch(0x5EED, (73, 2), 0x1000, 7)
    assert not calls
    assert ex_calls == [((73, 2, 1), (1024, 1, 1), 64, 0x5EED, 1, _launch._PROGRAMMATIC_STREAM_SERIALIZATION, 1,
                         0xAB, [struct.pack("=Q", 0x1000), struct.pack("=i", 7)], None)]
    with pytest.raises(DriverError) as error:
        launch(0, 1, 0x1000, 7)
    assert error.value.args == (700,)


@pytest.mark.parametrize("ptx_version,driver", [(80, 13000), (90, 12020)], ids=["sm80-build", "driver-12.2"])
def test_a_programmatic_launch_falls_back_to_a_plain_one(driver_calls, monkeypatch, ptx_version, driver):
    """A kernel built for a GPU without programmatic launches (ptx_version < 90), or a driver that
    cannot record one in a CUDA graph (before 12.3): a launch as any other, and no driver entry
    point beyond cuLaunchKernel is looked up."""
    calls, sizes = driver_calls
    sizes += [4]
    monkeypatch.setattr(_launch, "_driver_launch_ex", lambda: pytest.fail("cuLaunchKernelEx looked up"))
    monkeypatch.setitem(driver_version, "version", driver)
    launch = PackedLaunch(_programmatic_kernel(0xCD, ptx_version), 32, 0, ("i32",), programmatic=True)
    launch(0, 3, 5)
    assert not launch.programmatic and len(calls) == 1 and calls[0][1] == (3, 1, 1)
