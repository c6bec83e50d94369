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

import torch

CUDA_R_32F, CUDA_R_16BF = 0, 14  # cudaDataType
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_GEMM_DEFAULT = -1

# cuBLAS reads alpha and beta through host pointers (the handle's default pointer mode): these
# live as long as the module.
_ALPHA = ctypes.c_float(1.0)
_BETA = ctypes.c_float(0.0)
_ALPHA_PTR = ctypes.addressof(_ALPHA)
_BETA_PTR = ctypes.addressof(_BETA)


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
    i32, i64, ptr = ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p
    function.argtypes = [ptr, i32, i32, i32, i32, i32, ptr,
                         ptr, i32, i32, i64, ptr, i32, i32, i64, ptr,
                         ptr, i32, i32, i64, i32, i32, i32]
    function.restype = i32
    return function


def gemm_bf16_f32(x_ptr: int, w_ptr: int, y_ptr: int, *, rows: int, n: int, k: int, batch: int,
                  x_batch_stride: int, w_batch_stride: int, y_batch_stride: int) -> None:
    """Y[b] = X[b] @ W[b]^T on torch's current stream and device; strides in elements."""
    status = _gemm_function()(
        torch.cuda.current_blas_handle(), CUBLAS_OP_T, CUBLAS_OP_N, n, rows, k, _ALPHA_PTR,
        w_ptr, CUDA_R_16BF, k, w_batch_stride,
        x_ptr, CUDA_R_16BF, k, x_batch_stride, _BETA_PTR,
        y_ptr, CUDA_R_32F, n, y_batch_stride,
        batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
    if status != 0:
        raise RuntimeError(f"cublasGemmStridedBatchedEx failed with status {status}")
