"""The collapse's magnitude epilogue (`collapse_epilogue_v1`, kernels/collapse_v1.cu): stream 0 and
the N-1 fp32 projections in, the bf16 result out. v1 launches it after cuBLAS's projections, v2
(and v3 where it splits K) after the package's own GEMM.
"""

from __future__ import annotations

from .. import _sources
from .._launch import PackedLaunch, ceil_div

TARGET_THREADS = 512
EPILOGUE_ARGS = ("ptr", "ptr", "ptr", "i32", "i64", "f32")  # stream 0, projections, out, H, rows, eps


def epilogue_launch_shape(streams: int, hidden: int) -> tuple[int, int]:
    """(chunks per thread, threads per block) for one row of `hidden` elements.

    The fewest chunks whose block, at most TARGET_THREADS wide, covers the row in one sweep (the
    row then stays in registers); rows too wide for any of them take several sweeps of the widest
    block with one chunk each.
    """
    slices = hidden // 8
    for chunks in _sources.COLLAPSE_CHUNK_CHOICES:
        threads = max(32, ceil_div(ceil_div(slices, chunks), 32) * 32)
        if threads <= min(TARGET_THREADS, _sources.collapse_max_threads(streams, chunks)):
            return chunks, threads
    return 1, _sources.collapse_max_threads(streams, 1)


def epilogue_v1(streams: int, hidden: int) -> PackedLaunch:
    """The epilogue's launch for N = `streams` and H = `hidden` on the current device: one block
    per row (the grid's x extent allows 2^31 - 1 rows), arguments as EPILOGUE_ARGS; on Hopper a
    programmatic dependent launch (launched once the GEMM ahead releases it, at the latest as its
    blocks exit; the kernel waits for the projections: _launch)."""
    chunks, threads = epilogue_launch_shape(streams, hidden)
    kernel = _sources.COLLAPSE_V1.kernel(f"collapse_epilogue_v1<{streams}, {chunks}>")
    return PackedLaunch(kernel, threads, 0, EPILOGUE_ARGS, programmatic=True)
