"""bf16 x bf16 -> fp32 GEMMs through cuBLASLt, planned once per shape.

A `StridedBatchedGemm` builds its cuBLASLt descriptors and asks the heuristic for an algorithm
once; a call then only stores three addresses and the stream into ctypes slots and calls
`cublasLtMatmul` (no per-call heuristic, no argument conversion). cuBLASLt takes the stream and
the workspace as arguments on every call and keeps no per-stream state of its own, so the GEMMs
go to the caller's stream, are captured by CUDA graphs like any other work, and use a workspace
the caller allocated through torch's caching allocator.

Row-major `Y[b] = X[b] @ W[b]^T` for `batch` pairs of ([rows, k] activations, [n, k] weights) is
the column-major product `Y^T = op_T(W^T) X^T` that cuBLAS computes: A = W with op T, B = X with op
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
# cublasLtMatmulDescAttributes_t, cublasLtMatrixLayoutAttribute_t, cublasLtMatmulPreferenceAttributes_t
DESC_TRANSA, DESC_TRANSB = 3, 4
LAYOUT_BATCH_COUNT, LAYOUT_STRIDED_BATCH_OFFSET = 5, 6
PREF_MAX_WORKSPACE_BYTES = 1
# The most workspace an algorithm may ask for (split-K at small M wants some); the caller
# allocates what the chosen algorithm needs, `StridedBatchedGemm.workspace_bytes`.
MAX_WORKSPACE_BYTES = 32 << 20

# cuBLASLt reads alpha and beta through host pointers (the descriptor's default pointer mode):
# these live as long as the module.
_ALPHA = ctypes.c_float(1.0)
_BETA = ctypes.c_float(0.0)


class _Algo(ctypes.Structure):  # cublasLtMatmulAlgo_t
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", _Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cuBLAS status {status}")


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    """The libcublasLt torch has loaded (found by its soname, else in the process's maps)."""
    torch.cuda.current_blas_handle()  # makes torch load cuBLAS (and cuBLASLt with it)
    major = torch.version.cuda.split(".")[0]
    try:
        return ctypes.CDLL(f"libcublasLt.so.{major}")
    except OSError:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcublasLt.so" in line}
        if not paths:
            raise RuntimeError("cannot find the cuBLASLt library torch uses") from None
        return ctypes.CDLL(sorted(paths)[0])


@functools.lru_cache(maxsize=None)
def _handle(device: int) -> ctypes.c_void_p:
    """One cuBLASLt handle per device, for the life of the process."""
    handle = ctypes.c_void_p()
    with torch.cuda.device(device):
        _check(_library().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle


def _set(setter, descriptor, attribute: int, value) -> None:
    _check(setter(descriptor, attribute, ctypes.byref(value), ctypes.sizeof(value)), setter.__name__)


def _layout(dtype: int, rows: int, cols: int, ld: int, batch: int, batch_stride: int) -> ctypes.c_void_p:
    lt = _library()
    layout = ctypes.c_void_p()
    _check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, ctypes.c_uint64(rows),
                                         ctypes.c_uint64(cols), ctypes.c_int64(ld)), "cublasLtMatrixLayoutCreate")
    _set(lt.cublasLtMatrixLayoutSetAttribute, layout, LAYOUT_BATCH_COUNT, ctypes.c_int32(batch))
    _set(lt.cublasLtMatrixLayoutSetAttribute, layout, LAYOUT_STRIDED_BATCH_OFFSET, ctypes.c_int64(batch_stride))
    return layout


class StridedBatchedGemm:
    """One GEMM shape on the current device: descriptors and algorithm chosen at construction;
    `workspace_bytes` is what a call's workspace must hold. The descriptors live as long as the
    plan that owns this object (plans are cached for the life of the process)."""

    def __init__(self, *, rows: int, n: int, k: int, batch: int, x_batch_stride: int,
                 w_batch_stride: int, y_batch_stride: int):
        lt = _library()
        self.rows = rows
        handle = _handle(torch.cuda.current_device())
        desc = ctypes.c_void_p()
        _check(lt.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
               "cublasLtMatmulDescCreate")
        _set(lt.cublasLtMatmulDescSetAttribute, desc, DESC_TRANSA, ctypes.c_int32(CUBLAS_OP_T))
        _set(lt.cublasLtMatmulDescSetAttribute, desc, DESC_TRANSB, ctypes.c_int32(CUBLAS_OP_N))
        a = _layout(CUDA_R_16BF, k, n, k, batch, w_batch_stride)  # W^T viewed column-major, op T
        b = _layout(CUDA_R_16BF, k, rows, k, batch, x_batch_stride)
        c = _layout(CUDA_R_32F, n, rows, n, batch, y_batch_stride)
        preference = ctypes.c_void_p()
        _check(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "cublasLtMatmulPreferenceCreate")
        _set(lt.cublasLtMatmulPreferenceSetAttribute, preference, PREF_MAX_WORKSPACE_BYTES,
             ctypes.c_uint64(MAX_WORKSPACE_BYTES))
        result, found = _HeuristicResult(), ctypes.c_int(0)
        _check(lt.cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, c, c, preference, 1,
                                                 ctypes.byref(result), ctypes.byref(found)),
               "cublasLtMatmulAlgoGetHeuristic")
        lt.cublasLtMatmulPreferenceDestroy(preference)
        if found.value < 1:
            raise RuntimeError(f"cuBLASLt has no algorithm for bf16 x bf16 -> fp32, rows={rows}, n={n}, k={k}")
        self.workspace_bytes = int(result.workspaceSize)
        self._algo = result.algo
        self._function = lt.cublasLtMatmul
        self._function.restype = ctypes.c_int
        ptr = ctypes.c_void_p
        self._w, self._x, self._y, self._workspace, self._stream = ptr(), ptr(), ptr(), ptr(), ptr()
        self._descriptors = (desc, a, b, c)  # kept alive with the plan
        self._args = (handle, desc, ctypes.byref(_ALPHA), self._w, a, self._x, b, ctypes.byref(_BETA),
                      self._y, c, self._y, c, ctypes.byref(self._algo), self._workspace,
                      ctypes.c_size_t(self.workspace_bytes), self._stream)
        self._lock = threading.Lock()  # the address slots are shared by this plan's callers

    def __call__(self, x_ptr: int, w_ptr: int, y_ptr: int, workspace_ptr: int, stream: int) -> None:
        """Y[b] = X[b] @ W[b]^T on `stream`; `workspace_ptr` holds `workspace_bytes`."""
        with self._lock:
            self._x.value, self._w.value, self._y.value = x_ptr, w_ptr, y_ptr
            self._workspace.value, self._stream.value = workspace_ptr, stream
            status = self._function(*self._args)
        if status != 0:
            raise RuntimeError(f"cublasLtMatmul failed with cuBLAS status {status}")
