"""Host side of the AltUp collapse forward (docs/SPEC.md section 1).

v1: for each block of rows, cuBLAS projects streams 1..N-1 into an fp32 workspace (one strided
batched call when the weights are stacked, one call per weight otherwise), then one RawKernel
(`collapse_epilogue_v1` in collapse.cu) reads stream 0 and the projections once and writes the
bf16 result. The workspace is bounded: rows are processed in blocks of at most
`WORKSPACE_BYTES` of fp32 projections.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy

from . import _arrays, _cublas
from ._arrays import BF16, F32
from ._build import KernelSource

SUPPORTED_STREAMS = (2, 3, 4)
CHUNK_CHOICES = (1, 2, 4)
TARGET_THREADS = 512
WORKSPACE_BYTES = 1 << 30

SOURCE = KernelSource(
    "collapse.cu",
    tuple(f"collapse_epilogue_v1<{n}, {c}>" for n in SUPPORTED_STREAMS for c in CHUNK_CHOICES),
)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def max_threads(streams: int, chunks: int) -> int:
    """The `__launch_bounds__` of collapse_epilogue_v1<streams, chunks> (collapse_max_threads)."""
    return 1024 if streams * chunks <= 4 else 512 if streams * chunks <= 8 else 256


def epilogue_launch_shape(streams: int, hidden: int) -> tuple[int, int]:
    """(chunks per thread, threads per block) for one row of `hidden` elements.

    The fewest chunks whose block, at most TARGET_THREADS wide, covers the row in one sweep (the
    row then stays in registers); rows too wide for any of them take several sweeps of 1024
    threads with one chunk each.
    """
    slices = hidden // 8
    for chunks in CHUNK_CHOICES:
        threads = max(32, _round_up(_ceil_div(slices, chunks), 32))
        if threads <= min(TARGET_THREADS, max_threads(streams, chunks)):
            return chunks, threads
    return 1, max_threads(streams, 1)


def rows_per_block(rows: int, streams: int, hidden: int) -> int:
    """How many rows one GEMM + epilogue round handles, given the fp32 workspace bound."""
    per_row = (streams - 1) * hidden * 4
    return max(1, min(rows, WORKSPACE_BYTES // per_row))


def _validate(hidden_states: Any, unembed_projs: Any, eps: Any):
    hs = _arrays.accept("hidden_states", hidden_states, BF16, (None, None, None, None), vector_rows=True)
    streams, batch, seq, hidden = hs.shape
    if streams not in SUPPORTED_STREAMS:
        raise ValueError(f"hidden_states must hold N in {SUPPORTED_STREAMS} streams (dim 0), got {streams}")
    if hidden % 8:
        raise ValueError(f"hidden size H (hidden_states dim 3) must be divisible by 8, got {hidden}")
    if isinstance(unembed_projs, (list, tuple)):
        if len(unembed_projs) != streams - 1:
            raise ValueError(
                f"unembed_projs must hold N-1 = {streams - 1} matrices for N = {streams} streams, "
                f"got {len(unembed_projs)}"
            )
        weights = [
            _arrays.accept(f"unembed_projs[{i}]", w, BF16, (hidden, hidden))
            for i, w in enumerate(unembed_projs)
        ]
    else:
        try:
            weights = [_arrays.accept("unembed_projs", unembed_projs, BF16, (streams - 1, hidden, hidden))]
        except ValueError as error:
            raise ValueError(f"{error} (N-1 stacked [H, H] matrices, or a list of them)") from None
    eps = _arrays.positive_finite("eps", eps)
    framework, device = _arrays.same_device([hs, *weights])
    return hs, weights, eps, framework, device


def collapse(hidden_states: Any, unembed_projs: Sequence[Any] | Any, eps: float = 1e-5) -> Any:
    """Merge N AltUp streams into one hidden state.

    hidden_states: bf16 [N, B, S, H]; unembed_projs: N-1 bf16 [H, H] matrices (nn.Linear layout,
    y = x @ W^T), as a list or one stacked [N-1, H, H] array; eps: clamps the mean square of each
    projection. Returns bf16 [B, S, H] of the caller's type, computed on the caller's stream.
    """
    hs, weights, eps, framework, device = _validate(hidden_states, unembed_projs, eps)
    streams, batch, seq, hidden = hs.shape
    rows = batch * seq
    out = _arrays.empty(framework, hs, (batch, seq, hidden), BF16)
    if rows == 0:
        return out.array

    chunks, threads = epilogue_launch_shape(streams, hidden)
    block_rows = rows_per_block(rows, streams, hidden)
    stacked = len(weights) == 1
    with _arrays.caller_stream(framework, device) as stream:
        epilogue = SOURCE.kernel(f"collapse_epilogue_v1<{streams}, {chunks}>")
        workspace = _arrays.empty(framework, hs, ((streams - 1) * block_rows * hidden,), F32)
        hs_ptr, out_ptr, ws_ptr = hs.ptr, out.ptr, workspace.ptr
        stream_elems = rows * hidden
        for first in range(0, rows, block_rows):
            n_rows = min(block_rows, rows - first)
            x_ptr = hs_ptr + 2 * (stream_elems + first * hidden)  # stream 1, row `first`
            gemm = dict(rows=n_rows, n=hidden, k=hidden, x_batch_stride=stream_elems,
                        y_batch_stride=n_rows * hidden)
            if stacked:
                _cublas.gemm_bf16_f32(x_ptr, weights[0].ptr, ws_ptr, batch=streams - 1,
                                      w_batch_stride=hidden * hidden, **gemm)
            else:
                for k, w in enumerate(weights):
                    _cublas.gemm_bf16_f32(x_ptr + 2 * k * stream_elems, w.ptr,
                                          ws_ptr + 4 * k * n_rows * hidden, batch=1,
                                          w_batch_stride=0, **gemm)
            epilogue(
                (n_rows,), (threads,),
                (numpy.uint64(hs_ptr + 2 * first * hidden), numpy.uint64(ws_ptr),
                 numpy.uint64(out_ptr + 2 * first * hidden),
                 numpy.int32(hidden), numpy.int64(n_rows), numpy.float32(eps)),
                stream=stream,
            )
    return out.array
