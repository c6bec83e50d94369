"""The one place that accepts the caller's arrays.

CuPy arrays and torch CUDA tensors come in; the kernels read and write them in place through
their device pointers (no copy), on the caller's current stream and device, and the results
go back as the caller's type. Every argument is checked before anything runs, in a fixed order
(kind of object, dtype, rank and shape, contiguity, alignment, device), and a failed check raises a
TypeError or ValueError that names the argument, what was expected and what came.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import sys
from dataclasses import dataclass
from typing import Any, Sequence

BF16 = "bfloat16"
F32 = "float32"
_DLPACK_CUDA = 2  # DLDeviceType kDLCUDA


@dataclass(frozen=True)
class Arg:
    """A validated caller array: the object itself plus what the host code needs of it."""

    name: str
    array: Any
    framework: str  # "torch" or "cupy"
    shape: tuple[int, ...]
    dtype: str

    @property
    def ptr(self) -> int:
        return self.array.data_ptr() if self.framework == "torch" else self.array.data.ptr

    @property
    def device(self) -> int:
        kind, index = self.array.__dlpack_device__()
        return int(index)


def _framework_of(name: str, x: Any) -> str:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return "cupy"
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(x, numpy.ndarray):
        raise TypeError(
            f"{name} is a numpy array in host memory; expected a CuPy array or a torch CUDA tensor "
            "(move it to the GPU first, e.g. cupy.asarray(x) or torch.from_numpy(x).cuda())"
        )
    raise TypeError(f"{name} must be a CuPy array or a torch CUDA tensor, got {type(x).__name__}")


def _dtype_name(x: Any) -> str:
    return str(x.dtype).removeprefix("torch.")


def _is_contiguous(framework: str, x: Any) -> bool:
    return x.is_contiguous() if framework == "torch" else x.flags.c_contiguous


# The kernels read and write rows with 16-byte vector accesses (and the bulk-copy engine), which
# fault on a misaligned address: a view into a larger tensor can start anywhere.
VECTOR_ALIGNMENT = 16


def accept(name: str, x: Any, dtype: str, shape: Sequence[int | None], *, vector_rows: bool = False) -> Arg:
    """Check one argument's kind, dtype, shape (None = any extent) and contiguity; with
    `vector_rows`, also that it starts on a 16-byte boundary."""
    framework = _framework_of(name, x)
    got = _dtype_name(x)
    if got != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {got}")
    actual = tuple(int(d) for d in x.shape)
    expected = "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"
    if len(actual) != len(shape) or any(e is not None and e != a for e, a in zip(shape, actual)):
        raise ValueError(f"{name} must have shape {expected}, got {list(actual)}")
    if not _is_contiguous(framework, x):
        raise ValueError(
            f"{name} must be C-contiguous (a non-contiguous view would be read wrongly); "
            "pass x.contiguous() (torch) or cupy.ascontiguousarray(x)"
        )
    arg = Arg(name, x, framework, actual, got)
    if vector_rows and arg.ptr % VECTOR_ALIGNMENT:
        raise ValueError(
            f"{name} must start at a {VECTOR_ALIGNMENT}-byte aligned address (it starts "
            f"{arg.ptr % VECTOR_ALIGNMENT} bytes past one, e.g. a view at an odd offset); pass a copy "
            "(x.clone() in torch, x.copy() in CuPy)"
        )
    return arg


def same_device(args: Sequence[Arg]) -> tuple[str, int]:
    """All arguments are CUDA arrays of one framework on one device: return (framework, device)."""
    for arg in args:
        kind, index = arg.array.__dlpack_device__()
        if int(kind) != _DLPACK_CUDA:
            where = getattr(arg.array, "device", f"DLPack device type {int(kind)}")
            raise ValueError(f"{arg.name} is on {where}; expected a CUDA device")
    first = args[0]
    for arg in args[1:]:
        if arg.framework != first.framework:
            raise TypeError(
                f"{arg.name} is a {arg.framework} array but {first.name} is a {first.framework} "
                "array; pass arrays of one framework"
            )
        if arg.device != first.device:
            raise ValueError(
                f"{arg.name} is on CUDA device {arg.device} but {first.name} is on CUDA device "
                f"{first.device}; all arrays must be on one device"
            )
    return first.framework, first.device


def positive_finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v) or v <= 0.0:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return v


def index_in_range(name: str, value: Any, upper: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    v = int(value.__index__())
    if not 0 <= v < upper:
        raise ValueError(f"{name} must satisfy 0 <= {name} < {upper}, got {v}")
    return v


@contextlib.contextmanager
def caller_stream(framework: str, device: int):
    """Make the caller's current device and stream CuPy's current ones for the duration."""
    import cupy

    with cupy.cuda.Device(device):
        if framework == "torch":
            import torch

            stream = cupy.cuda.Stream.from_external(torch.cuda.current_stream(device))
            with stream:
                yield stream
        else:
            yield cupy.cuda.get_current_stream()


def empty(framework: str, like: Arg, shape: Sequence[int], dtype: str) -> Arg:
    """An uninitialised array of the caller's framework, on `like`'s device."""
    shape = tuple(int(d) for d in shape)
    if framework == "torch":
        import torch

        array = torch.empty(shape, dtype=getattr(torch, dtype), device=like.array.device)
    else:
        import cupy

        array = cupy.empty(shape, dtype=like.array.dtype if dtype == like.dtype else dtype)
    return Arg("output", array, framework, shape, dtype)


def zeros(framework: str, like: Arg, shape: Sequence[int], dtype: str) -> Any:
    """A zero-filled array of the caller's framework (the weight gradients of an empty batch)."""
    out = empty(framework, like, shape, dtype).array
    out.fill(0) if framework == "cupy" else out.zero_()
    return out
