"""The one place that accepts the caller's arrays.

Torch tensors and CuPy arrays come in. CuPy arrays become torch tensors through DLPack (no
copy), the op runs on the tensors, and the results go back as CuPy arrays, on the stream CuPy
calls current. Every argument is checked before anything runs, in a fixed order (kind of object,
dtype, rank, shape, contiguity, device, alignment), and a failed check raises a TypeError or
ValueError that names the argument, what was expected and what came.

The checks are cheap attribute reads: they run on every call, on the fast path too.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import sys
from typing import Any, Iterator, Sequence

import torch

from ._sources import SUPPORTED_STREAMS

# The dtypes the CPU references take (the kernels take bfloat16 alone); a call's tensors share one.
CPU_DTYPES = (torch.bfloat16, torch.float32, torch.float64)

# The kernels read and write rows with 16-byte vector accesses (and the bulk-copy engine), which
# fault on a misaligned address: a view into a larger tensor can start anywhere.
VECTOR_ALIGNMENT = 16


def is_cupy(x: Any) -> bool:
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


def as_tensor(name: str, x: Any) -> torch.Tensor:
    """`x` as a torch tensor: itself, or a CuPy array's memory viewed through DLPack."""
    if isinstance(x, torch.Tensor):
        return x
    if is_cupy(x):
        return torch.from_dlpack(x)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(x, numpy.ndarray):
        raise TypeError(
            f"{name} is a numpy array in host memory; expected a torch tensor or a CuPy array "
            "(move it to the GPU first, e.g. cupy.asarray(x) or torch.from_numpy(x).cuda())"
        )
    raise TypeError(f"{name} must be a torch tensor or a CuPy array, got {type(x).__name__}")


def _dims(names: str) -> str:
    return "[" + ", ".join(names.split()) + "]"


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: how the messages name a dtype."""
    return str(dtype).removeprefix("torch.")


def call_dtype(name: str, t: torch.Tensor) -> torch.dtype:
    """The dtype every tensor of a call must have, decided by its first tensor `t` (named `name`):
    bfloat16 for the kernels; on the CPU `t`'s own if the reference takes it, else a TypeError."""
    if t.device.type != "cpu":
        return torch.bfloat16
    if t.dtype not in CPU_DTYPES:
        *others, last = map(dtype_name, CPU_DTYPES)
        raise TypeError(f"{name} must have dtype {', '.join(others)} or {last} on the CPU, got {dtype_name(t.dtype)}")
    return t.dtype


def check_tensor(name: str, t: torch.Tensor, dtype: torch.dtype, shape: Sequence[int | None],
                 dims: str) -> None:
    """dtype, rank, extents and contiguity of one tensor (`check_shape` says how `shape` reads).
    The common case (all fine) costs a few comparisons and no call; the messages are built only on
    failure (it runs on every call of the ops' fast paths)."""
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype_name(dtype)}, got {dtype_name(t.dtype)}")
    if (t.dim() != len(shape)) if None in shape else (t.shape != shape):  # check_shape's test, inlined
        _shape_error(name, t, shape, dims)
    if not t.is_contiguous():
        _not_contiguous(name)


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int | None], dims: str) -> None:
    """The extents `shape`; a shape holding None (any extent) checks the rank alone, so the
    callers' wildcard shapes are all None. `dims` names the axes ("N B S H"), so a wrong rank says
    which layout was expected."""
    if (t.dim() != len(shape)) if None in shape else (t.shape != shape):
        _shape_error(name, t, shape, dims)


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        _not_contiguous(name)


def _not_contiguous(name: str):
    raise ValueError(f"{name} must be C-contiguous (a non-contiguous view would be read wrongly); "
                     "pass x.contiguous() (torch) or cupy.ascontiguousarray(x)")


def _shape_error(name: str, t: torch.Tensor, shape: Sequence[int | None], dims: str):
    if t.dim() != len(shape):
        raise ValueError(f"{name} must be a {len(shape)}-D tensor {_dims(dims)}, got a {t.dim()}-D "
                         f"tensor of shape {list(t.shape)}")
    expected = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
    raise ValueError(f"{name} must have shape {expected} ({_dims(dims)}), got {list(t.shape)}")


def check_streams_and_width(name: str, streams: int, hidden: int, hidden_dim: str = "dim 3") -> None:
    """N (dim 0 of `name`) is a stream count the kernels are built for, and the rows split into
    whole 16-byte (8-element) slices."""
    if streams not in SUPPORTED_STREAMS:
        raise ValueError(f"{name} must hold N in {SUPPORTED_STREAMS} streams (dim 0), got {streams}")
    if hidden <= 0 or hidden % 8:
        raise ValueError(f"hidden size H ({name} {hidden_dim}) must be positive and divisible by 8, got {hidden}")


def check_devices(named: Sequence[tuple[str, torch.Tensor]]) -> torch.device:
    """All tensors on one device: return it."""
    first_name, first = named[0]
    device = first.device
    for name, t in named[1:]:
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {device}; "
                             "all tensors must be on one device")
    return device


def check_aligned(named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Every tensor starts on a 16-byte boundary (real CUDA tensors only: fake and meta tensors
    have no address)."""
    for name, t in named:
        offset = t.data_ptr() % VECTOR_ALIGNMENT
        if offset:
            raise ValueError(
                f"{name} must start at a {VECTOR_ALIGNMENT}-byte aligned address (it starts "
                f"{offset} bytes past one, e.g. a view at an odd offset); pass a copy "
                "(x.clone() in torch, x.copy() in CuPy)"
            )


def positive_finite(name: str, value: Any) -> float:
    """`value` as a float, or a named error. Comparisons only (not math.isfinite): torch.compile with
    dynamic=True traces a float argument as a symbolic float, which compares (and guards) but has
    no math.isfinite."""
    # The common case first: isinstance of a concrete class is fast, numbers.Real (an ABC) is not.
    # (Not `type(value) is float`: torch.compile cannot guard the type of a constant it traced.)
    if isinstance(value, float) and 0.0 < value < math.inf:
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    v = float(value)
    if not 0.0 < v < math.inf:  # false for NaN too
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return v


def as_index(name: str, value: Any) -> int:
    """`value` as an int (an int, or an integer type that has `__index__`, as numpy's), or a
    TypeError naming it; a bool is refused (True is not a stream index), and so is a tensor (its
    value would cost a device synchronisation; pass int(t)). A symbolic int (torch.compile traced
    the argument as dynamic) passes as it is: the checks compare it, which guards on its value."""
    if type(value) is int:
        return value
    if isinstance(value, torch.SymInt):
        return value
    if isinstance(value, (bool, torch.Tensor)) or not isinstance(value, int) and not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value.__index__())


def index_in_range(name: str, value: Any, upper: int) -> int:
    v = as_index(name, value)
    if not 0 <= v < upper:
        raise ValueError(f"{name} must satisfy 0 <= {name} < {upper}, got {v}")
    return v


def check_framework(named: Sequence[tuple[str, Any]]) -> bool:
    """Whether the caller passed CuPy arrays; mixing CuPy and torch is refused."""
    if all(isinstance(x, torch.Tensor) for _, x in named):
        return False
    first_name, first = named[0]
    cupy_in = is_cupy(first)
    for name, x in named[1:]:
        if is_cupy(x) != cupy_in and (isinstance(x, torch.Tensor) or is_cupy(x)):
            kinds = ("a CuPy array", "a torch tensor") if cupy_in else ("a torch tensor", "a CuPy array")
            raise TypeError(f"{name} is {kinds[1]} but {first_name} is {kinds[0]}; "
                            "pass arrays of one framework")
    return cupy_in


@contextlib.contextmanager
def cupy_caller_stream(device: torch.device) -> Iterator[None]:
    """Make CuPy's current stream torch's current stream (for a CuPy caller's arrays)."""
    import cupy

    with cupy.cuda.Device(device.index):
        ptr = cupy.cuda.get_current_stream().ptr
        stream = (torch.cuda.default_stream(device) if ptr == 0
                  else torch.cuda.ExternalStream(ptr, device=device))
        with torch.cuda.device(device), torch.cuda.stream(stream):
            yield


def to_cupy(t: torch.Tensor) -> Any:
    import cupy

    return cupy.from_dlpack(t)
