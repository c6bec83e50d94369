"""bf16 x bf16 -> fp32 GEMMs on torch's cuBLAS handle, called directly.

`torch.cuda.current_blas_handle()` is the handle PyTorch has bound to its current stream, with a
workspace set for that stream: what cuBLAS needs to be captured in a CUDA graph. Calling
`cublasGemmStridedBatchedEx` on it through ctypes skips the dispatcher and the tensor views a
`torch.bmm` call would need (a few microseconds of host time each) while issuing the same kind of
cuBLAS call.

Row-major `Y[b] = X[b] @ W[b]^T` for `batch` pairs of ([rows, k] activations, [n, k] weights) is
the column-major product `Y^T = W^T^T X^T` that cuBLAS computes: A = W with op T, B = X with op
N, both read in place; fp32 C and fp32 compute (docs/SPEC.md section 1: a bf16 C fails the
tolerance).
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

CUDA_R_32F, CUDA_R_16BF = 0, 14  # cudaDataType
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_GEMM_DEFAULT = -1

# cuBLAS reads alpha and beta through host pointers (the handle's default pointer mode): these
# live as long as the module.
_ALPHA = ctypes.c_float(1.0)
_BETA = ctypes.c_float(0.0)


@functools.lru_cache(maxsize=None)
def _gemm_function():
    """cublasGemmStridedBatchedEx of the libcublas torch has loaded."""
    torch.cuda.current_blas_handle()  # makes torch load cuBLAS and create its handle
    major = torch.version.cuda.split(".")[0]
    try:
        library = ctypes.CDLL(f"libcublas.so.{major}")  # the loaded copy, found by its soname
    except OSError:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcublas.so" in line and "Lt" not in line}
        if not paths:
            raise RuntimeError("cannot find the cuBLAS library torch uses") from None
        library = ctypes.CDLL(sorted(paths)[0])
    function = library.cublasGemmStridedBatchedEx
    function.restype = ctypes.c_int
    return function


class StridedBatchedGemm:
    """One GEMM shape with its arguments held as ctypes values: a call stores the handle and the
    three addresses and passes the rest as they are (no per-call argument conversion)."""

    def __init__(self, *, rows: int, n: int, k: int, batch: int, x_batch_stride: int,
                 w_batch_stride: int, y_batch_stride: int):
        i32, i64, ptr = ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p
        self.rows = rows
        self._function = _gemm_function()
        self._handle, self._w, self._x, self._y = ptr(), ptr(), ptr(), ptr()
        self._args = (
            self._handle, i32(CUBLAS_OP_T), i32(CUBLAS_OP_N), i32(n), i32(rows), i32(k), ctypes.byref(_ALPHA),
            self._w, i32(CUDA_R_16BF), i32(k), i64(w_batch_stride),
            self._x, i32(CUDA_R_16BF), i32(k), i64(x_batch_stride), ctypes.byref(_BETA),
            self._y, i32(CUDA_R_32F), i32(n), i64(y_batch_stride),
            i32(batch), i32(CUBLAS_COMPUTE_32F), i32(CUBLAS_GEMM_DEFAULT))
        self._lock = threading.Lock()  # the address slots are shared by this plan's callers

    def __call__(self, x_ptr: int, w_ptr: int, y_ptr: int) -> None:
        """Y[b] = X[b] @ W[b]^T on torch's current stream and device."""
        with self._lock:
            self._handle.value = torch.cuda.current_blas_handle()
            self._x.value, self._w.value, self._y.value = x_ptr, w_ptr, y_ptr
            status = self._function(*self._args)
        if status != 0:
            raise RuntimeError(f"cublasGemmStridedBatchedEx failed with status {status}")


def gemm_bf16_f32(x_ptr: int, w_ptr: int, y_ptr: int, **shape: int) -> None:
    """One-off Y[b] = X[b] @ W[b]^T (shape as StridedBatchedGemm's keywords, strides in elements)."""
    StridedBatchedGemm(**shape)(x_ptr, w_ptr, y_ptr)
