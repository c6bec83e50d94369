"""The collapse's kernel versions and their launch plans (docs/SPEC.md section 1).

v1: the projections y_k = x_k @ W_k^T by cuBLASLt (bf16 in, fp32 out; one strided batched call
when the weights are stacked, one per weight otherwise; planned once per shape, on the current
stream, so CUDA graphs capture them: `_cublas`), into an fp32 workspace; then one RawKernel
(`collapse_epilogue_v1`) reads stream 0 and the projections once and writes the bf16 result. Rows
are processed in blocks of at most `WORKSPACE_BYTES` of fp32 projections. One buffer holds a
call's projections and cuBLASLt's workspace: lent from call to call on the eager fast path
(`_scratch`), else allocated per call.
v2, v3: the package's own Hopper GEMM (ops/collapse_hopper.py).

A plan is built once per (version, N, M, H, stacked weights or a list, device) and called as every
plan is (`_registry`): inputs (hidden_states, *weights), outputs (out,).
"""

from __future__ import annotations

import functools

import torch

from .. import _cublas, _sources
from .._launch import round_up
from .._scratch import StreamScratch
from . import collapse_hopper
from ._registry import Version
from .collapse_epilogue import epilogue_v1

WORKSPACE_BYTES = 1 << 30
# The projections and cuBLASLt's workspace of one call, one buffer (reused on the eager fast path).
_WORKSPACE = StreamScratch()


def rows_per_block(rows: int, streams: int, hidden: int) -> int:
    """How many rows one GEMM + epilogue round handles, given the fp32 workspace bound."""
    per_row = (streams - 1) * hidden * 4
    return max(1, min(rows, WORKSPACE_BYTES // per_row))


class V1Plan:
    """One shape's v1: the GEMMs of each row block, then the epilogue, all with packed arguments."""

    def __init__(self, streams: int, rows: int, hidden: int, stacked: bool):
        self.epilogue = epilogue_v1(streams, hidden)
        self.streams, self.rows, self.hidden, self.stacked = streams, rows, hidden, stacked
        self.block_rows = rows_per_block(rows, streams, hidden)
        self.blocks = [(first, min(self.block_rows, rows - first)) for first in range(0, rows, self.block_rows)]
        # One GEMM per distinct row-block size: stacked weights in one strided batched call,
        # listed weights one call each.
        self.gemms = {
            count: _cublas.Gemm(
                rows=count, cols=hidden, inner=hidden, batch=streams - 1 if stacked else 1,
                x_batch_stride=rows * hidden, y_batch_stride=hidden * hidden if stacked else 0,
                d_batch_stride=count * hidden)
            for count in {count for _, count in self.blocks}}
        projection_bytes = (streams - 1) * self.block_rows * hidden * 4
        self.gemm_workspace_offset = round_up(projection_bytes, 256)
        self.workspace_bytes = self.gemm_workspace_offset + max(g.workspace_bytes for g in self.gemms.values())

    def __call__(self, inputs: tuple[torch.Tensor, ...], outputs: tuple[torch.Tensor], scalars: tuple[float],
                 stream: int, reuse_scratch: bool) -> None:
        hidden_states, *weights = inputs
        out, = outputs
        eps, = scalars
        hidden, stream_elements = self.hidden, self.rows * self.hidden
        workspace, key = _WORKSPACE.take(self.workspace_bytes, hidden_states.device, stream, reuse_scratch)
        hs, ws, out_ptr = hidden_states.data_ptr(), workspace.data_ptr(), out.data_ptr()
        gemm_ws = ws + self.gemm_workspace_offset
        w_ptrs = [w.data_ptr() for w in weights]
        for first, count in self.blocks:
            x = hs + 2 * (stream_elements + first * hidden)  # stream 1, row `first`
            gemm = self.gemms[count]
            if self.stacked:
                gemm(x, w_ptrs[0], ws, gemm_ws, stream)
            else:
                for k, w in enumerate(w_ptrs):
                    gemm(x + 2 * k * stream_elements, w, ws + 4 * k * count * hidden, gemm_ws, stream)
            self.epilogue(stream, count, hs + 2 * first * hidden, ws, out_ptr + 2 * first * hidden,
                          hidden, count, eps)
        _WORKSPACE.give_back(workspace, key)


@functools.lru_cache(maxsize=256)
def _v1_plan(streams: int, rows: int, hidden: int, stacked: bool, device: int) -> V1Plan:
    with torch.cuda.device(device):
        return V1Plan(streams, rows, hidden, stacked)


VERSIONS = {
    1: Version(
        number=1,
        note="cuBLAS projections into an fp32 workspace, then one fused epilogue kernel",
        sources=(_sources.COLLAPSE_V1,),
        supports=lambda streams, hidden: True,
        plan=_v1_plan,
    ),
    2: Version(2, "own sm_90a GEMM (TMA, wgmma, producer/consumer warpgroups, persistent grid, split-K "
                  "at small M) into the fp32 workspace, then v1's epilogue",
               (_sources.COLLAPSE_V2, _sources.COLLAPSE_V1), lambda streams, hidden: True,
               functools.partial(collapse_hopper.plan, 2),
               kept_because="teaching step: the package's own Hopper GEMM, whose epilogue a normalisation "
                            "fused into the GEMM can change (cuBLASLt's is closed); with v1's epilogue it is "
                            "4-45% (median 7%) slower than v1's cuBLASLt GEMMs (H200, 16 benchmark workloads)"),
    # Where K is split (small M), v3 runs v2's kernels.
    3: Version(3, "row sums of squares from the GEMM's fp32 accumulators, so the epilogue reads y_k once",
               (_sources.COLLAPSE_V3, _sources.COLLAPSE_V2, _sources.COLLAPSE_V1), lambda streams, hidden: True,
               functools.partial(collapse_hopper.plan, 3),
               kept_because="teaching step: the row statistics move into the GEMM's accumulators, the step "
                            "toward a normalisation for free; limited by v2's GEMM (within 3.4% of v2 on "
                            "every benchmark workload, H200)"),
}
# The default: the first of these that runs on the device and shape.
PREFERENCE = (1,)
