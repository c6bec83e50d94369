"""bf16 x bf16 -> fp32 GEMMs through CuPy's cuBLAS binding: a benchmark baseline.

Row-major `Y[b] = X[b] @ W[b]^T` as the column-major product `Y^T = W^T^T X^T` that cuBLAS computes:
A = W with op T, B = X with op N, both read in place, fp32 C and fp32 compute. This is how the
package first ran the collapse's projections: CuPy's binding refuses to run while a stream is
capturing a CUDA graph.
"""

from __future__ import annotations

import numpy
import torch

CUDA_R_32F, CUDA_R_16BF = 0, 14  # cudaDataType
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_GEMM_DEFAULT = -1

# cuBLAS reads alpha and beta through host pointers: keep the arrays alive for the module's life.
_ALPHA = numpy.ones(1, dtype=numpy.float32)
_BETA = numpy.zeros(1, dtype=numpy.float32)


def gemm_bf16_f32(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
    """y[b] = x[b] @ w[b]^T for x [batch, rows, k] (rows contiguous, any batch stride), w
    [batch, n, k] and y [batch, rows, n] contiguous, on torch's current stream."""
    import cupy
    from cupy.cuda import cublas

    batch, rows, k = x.shape
    n = w.shape[1]
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    with cupy.cuda.Device(x.device.index), stream:
        cublas.gemmStridedBatchedEx(
            cupy.cuda.device.get_cublas_handle(), CUBLAS_OP_T, CUBLAS_OP_N, n, rows, k,
            _ALPHA.ctypes.data,
            w.data_ptr(), CUDA_R_16BF, k, w.stride(0),
            x.data_ptr(), CUDA_R_16BF, k, x.stride(0),
            _BETA.ctypes.data,
            y.data_ptr(), CUDA_R_32F, n, y.stride(0),
            batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT,
        )
