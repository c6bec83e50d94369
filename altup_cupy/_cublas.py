"""bf16 x bf16 GEMMs with fp32 accumulation through cuBLASLt, planned once per shape.

A `Gemm` builds its cuBLASLt descriptors and asks the heuristic for an algorithm once; a call then
only stores three addresses and the stream into ctypes slots and calls `cublasLtMatmul` (no
per-call heuristic, no argument conversion, no tensor views: operands are addresses). cuBLASLt
takes the stream and the workspace as arguments on every call and keeps no per-stream state of its
own, so the GEMMs go to the caller's stream, are captured by CUDA graphs like any other work, and
use a workspace the caller allocated through torch's caching allocator.

A `Gemm` is written in row-major terms, as the package's tensors are laid out:
`D[b] = op(X[b]) @ op(Y[b]) (+ D[b] if accumulating)`, D [rows, cols] in fp32 or bf16, X and Y
bf16, each operand read in place with its own leading dimension (a column block of a wider matrix
is a pointer and a leading dimension) and optionally transposed. cuBLAS is column-major: the
row-major D is the column-major D^T = op(Y)^T op(X)^T, so Y is cuBLAS's A and X its B, and a
row-major operand used as stored is a column-major one used transposed.
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
# cublasLtMatmulAlgoConfigAttributes_t: how a chosen algorithm is configured (`Gemm.config`)
ALGO_CONFIG = {"algo_id": (0, ctypes.c_int32), "tile": (1, ctypes.c_uint32), "split_k": (2, ctypes.c_int32),
               "reduction_scheme": (3, ctypes.c_uint32), "swizzle": (4, ctypes.c_uint32),
               "custom_option": (5, ctypes.c_uint32), "stages": (6, ctypes.c_uint32),
               "inner_shape": (7, ctypes.c_uint16), "cluster_shape": (8, ctypes.c_uint16)}
# The most workspace an algorithm may ask for (split-K at small M wants some); the caller
# allocates what the chosen algorithm needs, `Gemm.workspace_bytes`.
MAX_WORKSPACE_BYTES = 32 << 20

# cuBLASLt reads alpha and beta through host pointers (the descriptor's default pointer mode):
# these live as long as the module.
_ONE = ctypes.c_float(1.0)
_ZERO = ctypes.c_float(0.0)


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


OUT_TYPES = {torch.float32: CUDA_R_32F, torch.bfloat16: CUDA_R_16BF}


class Gemm:
    """One GEMM shape on the current device: descriptors and algorithm chosen at construction;
    `workspace_bytes` is what a call's workspace must hold. The descriptors live as long as the
    plan that owns this object (plans are cached for the life of the process).

    rows, cols, inner: D is [rows, cols], the product's inner extent `inner`. x_transposed: X is
    stored [inner, rows] (used as its transpose), else [rows, inner]; y_transposed: Y is stored
    [cols, inner] (nn.Linear's weight layout), else [inner, cols]. ldx, ldy, ldd: row strides in
    elements (None: the stored row length). batch > 1: that many products, operand b at
    b * <operand>_batch_stride elements (0 repeats one operand). accumulate: D += product
    (beta = 1; cuBLASLt reads C = D in place), else D = product. candidate: which of the
    heuristic's algorithms, in its order (0, its first choice, is what the package runs; the
    algorithm sweep, scripts/sweep_cublas_algos.py, times the others); a candidate the heuristic
    does not offer for this shape raises IndexError."""

    def __init__(self, *, rows: int, cols: int, inner: int, x_transposed: bool = False,
                 y_transposed: bool = True, ldx: int | None = None, ldy: int | None = None,
                 ldd: int | None = None, out_dtype: torch.dtype = torch.float32, batch: int = 1,
                 x_batch_stride: int = 0, y_batch_stride: int = 0, d_batch_stride: int = 0,
                 accumulate: bool = False, candidate: int = 0):
        lt = _library()
        self.rows = rows
        ldx = ldx or (rows if x_transposed else inner)
        ldy = ldy or (inner if y_transposed else cols)
        ldd = ldd or cols
        handle = _handle(torch.cuda.current_device())
        desc = ctypes.c_void_p()
        _check(lt.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
               "cublasLtMatmulDescCreate")
        # cuBLAS's A is Y: a row-major [inner, cols] Y is the column-major [cols, inner] Y^T that
        # the column-major product wants, so it is used as stored (N); a [cols, inner] Y is used
        # transposed (T). Likewise B is X.
        _set(lt.cublasLtMatmulDescSetAttribute, desc, DESC_TRANSA,
             ctypes.c_int32(CUBLAS_OP_T if y_transposed else CUBLAS_OP_N))
        _set(lt.cublasLtMatmulDescSetAttribute, desc, DESC_TRANSB,
             ctypes.c_int32(CUBLAS_OP_T if x_transposed else CUBLAS_OP_N))
        a = (_layout(CUDA_R_16BF, inner, cols, ldy, batch, y_batch_stride) if y_transposed
             else _layout(CUDA_R_16BF, cols, inner, ldy, batch, y_batch_stride))
        b = (_layout(CUDA_R_16BF, rows, inner, ldx, batch, x_batch_stride) if x_transposed
             else _layout(CUDA_R_16BF, inner, rows, ldx, batch, x_batch_stride))
        d = _layout(OUT_TYPES[out_dtype], cols, rows, ldd, batch, d_batch_stride)
        preference = ctypes.c_void_p()
        _check(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "cublasLtMatmulPreferenceCreate")
        _set(lt.cublasLtMatmulPreferenceSetAttribute, preference, PREF_MAX_WORKSPACE_BYTES,
             ctypes.c_uint64(MAX_WORKSPACE_BYTES))
        results, found = (_HeuristicResult * (candidate + 1))(), ctypes.c_int(0)
        _check(lt.cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, d, d, preference, candidate + 1,
                                                 results, ctypes.byref(found)),
               "cublasLtMatmulAlgoGetHeuristic")
        lt.cublasLtMatmulPreferenceDestroy(preference)
        if found.value < 1:
            raise RuntimeError(f"cuBLASLt has no algorithm for bf16 x bf16 -> {out_dtype}, rows={rows}, "
                               f"cols={cols}, inner={inner}")
        if found.value <= candidate:
            raise IndexError(f"cuBLASLt's heuristic offers {found.value} algorithms for this shape; "
                             f"there is no candidate {candidate}")
        result = results[candidate]
        self.workspace_bytes = int(result.workspaceSize)
        self.waves = float(result.wavesCount)
        self._algo = result.algo
        self._function = lt.cublasLtMatmul
        self._function.restype = ctypes.c_int
        ptr = ctypes.c_void_p
        self._x, self._y, self._d, self._workspace, self._stream = ptr(), ptr(), ptr(), ptr(), ptr()
        self._descriptors = (desc, a, b, d)  # kept alive with the plan
        beta = _ONE if accumulate else _ZERO
        self._args = (handle, desc, ctypes.byref(_ONE), self._y, a, self._x, b, ctypes.byref(beta),
                      self._d, d, self._d, d, ctypes.byref(self._algo), self._workspace,
                      ctypes.c_size_t(self.workspace_bytes), self._stream)
        self._lock = threading.Lock()  # the address slots are shared by this plan's callers

    @property
    def config(self) -> dict[str, int]:
        """The chosen algorithm's configuration (ALGO_CONFIG's names: tile, split_k, stages...)."""
        lt, values = _library(), {}
        for name, (attribute, ctype) in ALGO_CONFIG.items():
            value, written = ctype(0), ctypes.c_size_t(0)
            _check(lt.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(self._algo), attribute, ctypes.byref(value),
                                                           ctypes.sizeof(value), ctypes.byref(written)),
                   "cublasLtMatmulAlgoConfigGetAttribute")
            values[name] = int(value.value)
        return values

    def __call__(self, x_ptr: int, y_ptr: int, d_ptr: int, workspace_ptr: int, stream: int) -> None:
        """The product on `stream`; `workspace_ptr` holds `workspace_bytes`."""
        with self._lock:
            self._x.value, self._y.value, self._d.value = x_ptr, y_ptr, d_ptr
            self._workspace.value, self._stream.value = workspace_ptr, stream
            status = self._function(*self._args)
        if status != 0:
            raise RuntimeError(f"cublasLtMatmul failed with cuBLAS status {status}")


@functools.lru_cache(maxsize=1024)
def plan(device: int, **shape) -> Gemm:
    """The `Gemm` of `shape` (Gemm's keywords) on CUDA device `device`, built once."""
    with torch.cuda.device(device):
        return Gemm(**shape)
