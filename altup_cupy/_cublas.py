"""bf16 x bf16 -> fp32 GEMMs through `cupy.cuda.cublas`.

Row-major `Y[b] = X[b] @ W[b]^T` for `batch` pairs of ([rows, k] activations, [n, k] weights),
written as the column-major product `Y^T = W^T^T X^T` that cuBLAS computes: A = W with op T,
B = X with op N, both read in place. fp32 C and fp32 compute (docs/SPEC.md section 1: a bf16 C fails
the tolerance).
"""

from __future__ import annotations

import numpy

# cudaDataType / cublasComputeType_t / cublasOperation_t / cublasGemmAlgo_t values.
CUDA_R_32F = 0
CUDA_R_16BF = 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
CUBLAS_GEMM_DEFAULT = -1

# cuBLAS reads alpha and beta through host pointers: keep the arrays alive for the module's life
# (the pointer of a temporary dangles by the time cuBLAS reads it).
_ALPHA = numpy.ones(1, dtype=numpy.float32)
_BETA = numpy.zeros(1, dtype=numpy.float32)


def gemm_bf16_f32(
    x_ptr: int, w_ptr: int, y_ptr: int, *, rows: int, n: int, k: int, batch: int,
    x_batch_stride: int, w_batch_stride: int, y_batch_stride: int,
) -> None:
    """Y[b] = X[b] @ W[b]^T on CuPy's current device and stream; strides are in elements."""
    import cupy
    from cupy.cuda import cublas

    if rows == 0 or batch == 0:
        return
    handle = cupy.cuda.device.get_cublas_handle()
    # CuPy binds the handle to its current stream inside the call.
    cublas.gemmStridedBatchedEx(
        handle, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, k,
        _ALPHA.ctypes.data,
        w_ptr, CUDA_R_16BF, k, w_batch_stride,
        x_ptr, CUDA_R_16BF, k, x_batch_stride,
        _BETA.ctypes.data,
        y_ptr, CUDA_R_32F, n, y_batch_stride,
        batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT,
    )
