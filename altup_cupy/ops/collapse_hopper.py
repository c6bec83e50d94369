"""The collapse forward on Hopper (sm_90a): the projections by this package's own GEMM.

v2: `collapse_gemm_sm90<0>` (kernels/collapse_gemm_sm90.cuh, instantiated by collapse_v2.cu)
computes y_k = x_k @ W_k^T for all N-1 streams in one persistent launch (TMA tile loads into a
4-stage shared-memory ring, wgmma on two consumer warpgroups, a producer warpgroup); when M is
small the K dimension is split so that every SM streams its share of the weights, and
`collapse_split_sum` adds the splits' fp32 partials in a fixed order. The magnitude epilogue is
v1's (`collapse_epilogue_v1`).
v3: `collapse_gemm_sm90<1>` (collapse_v3.cu) also writes each row's sum of squares per column
tile from its fp32 accumulators (fixed order, no atomics), so `collapse_epilogue_v3` needs no
reduction over y_k and reads it once, streamed. It applies when K is not split (M large enough to
fill the GPU with output tiles); otherwise v3 runs v2's kernels.

The GEMM's one parameter is a struct passed by value (`CollapseGemmParams`, holding the TMA tensor
maps), packed by `_launch.PackedLaunch` like any other argument list. A `HopperPlan` is built once
per shape and takes inputs the op has validated (ops/collapse.py). A tensor map holds its matrix's
address, so a plan keeps the maps of the last call's hidden states and of its weights and encodes
new ones only when an address changes (weights keep theirs from call to call).
"""

from __future__ import annotations

import ctypes
import functools
import struct
from dataclasses import dataclass
from typing import Sequence

import torch

from .. import _arrays, _device, _sources
from .._launch import ByValue, PackedLaunch, ceil_div, round_up
from .._scratch import StreamScratch
from .collapse_epilogue import epilogue_v1

_TILE = _sources.COLLAPSE_GEMM_TILE
BLOCK_M, BLOCK_N, BLOCK_K = _TILE["COLLAPSE_V2_BLOCK_M"], _TILE["COLLAPSE_V2_BLOCK_N"], _TILE["COLLAPSE_V2_BLOCK_K"]
STAGES = _TILE["COLLAPSE_V2_STAGES"]
THREADS = 128 * (1 + _TILE["COLLAPSE_V2_CONSUMERS"])  # a producer warpgroup and the consumers
# The ring (aligned for the swizzle) and its full and empty barriers (kSharedBytes).
SHARED_BYTES = _TILE["COLLAPSE_V2_SWIZZLE_ALIGN"] + STAGES * (BLOCK_M + BLOCK_N) * BLOCK_K * 2 + 2 * STAGES * 8
MAX_PROJECTIONS = _TILE["COLLAPSE_V2_MAX_PROJECTIONS"]
TENSOR_MAP_BYTES = 128
# CollapseGemmParams (collapse_gemm_sm90.cuh) field by field in declaration order, as `struct`
# codes: its natural C layout has no padding between fields (tests/test_collapse_hopper.py checks
# the offsets against the declaration), only at the end, up to the tensor maps' 64-byte alignment.
PARAM_FIELDS = (
    ("x_maps", f"{MAX_PROJECTIONS * TENSOR_MAP_BYTES}s"), ("w_maps", f"{MAX_PROJECTIONS * TENSOR_MAP_BYTES}s"),
    ("out", "Q"), ("row_sumsq", "Q"), ("rows", "q"), ("hidden", "i"), ("projections", "i"),
    ("row_tiles", "i"), ("col_tiles", "i"), ("k_blocks", "i"), ("splits", "i"), ("k_blocks_per_split", "i"),
    ("units", "i"),
)
_FIELDS_BYTES = struct.calcsize("=" + "".join(code for _, code in PARAM_FIELDS))
PARAMS_BYTES = round_up(_FIELDS_BYTES, 64)
PARAMS = ByValue("".join(code for _, code in PARAM_FIELDS) + f"{PARAMS_BYTES - _FIELDS_BYTES}x")
# A K split streams at least this many 64-wide K blocks, so the per-unit pipeline fill and the
# partial's write stay small next to its loads.
MIN_K_BLOCKS_PER_SPLIT = 4
SPLIT_SUM_THREADS = 256
SPLIT_SUM_ARGS = ("ptr", "ptr", "i32", "i64")  # partials, y, splits, float4 count
EPILOGUE_V3_ARGS = ("ptr",) * 4 + ("i32", "i64", "i32", "f32")  # stream 0, y, row_sumsq, out, H, rows, tiles, eps
SOURCES = (_sources.COLLAPSE_V2, _sources.COLLAPSE_V3)  # by GEMM mode


@dataclass(frozen=True)
class GemmPlan:
    """The persistent grid's work for one shape: units of (projection, row tile, column tile,
    K split), handed out round-robin to `grid` CTAs."""

    rows: int
    hidden: int
    projections: int
    row_tiles: int
    col_tiles: int
    k_blocks: int
    splits: int
    k_blocks_per_split: int
    units: int
    grid: int


def plan_gemm(rows: int, hidden: int, projections: int, sms: int, split_k: bool = True) -> GemmPlan:
    """Tiles for M = `rows`, H = `hidden`, N-1 = `projections` on a GPU with `sms` SMs.

    With `split_k`, when the output tiles alone cannot occupy every SM (small M: weight-bandwidth
    bound), K is split into as many ranges as fill the SMs, each at least MIN_K_BLOCKS_PER_SPLIT blocks long;
    the split count is then lowered until no range is empty.
    """
    if rows < 1 or hidden < 8 or hidden % 8 or not 1 <= projections <= MAX_PROJECTIONS or sms < 1:
        raise ValueError(
            f"plan_gemm needs rows >= 1, hidden a positive multiple of 8, 1 <= projections <= "
            f"{MAX_PROJECTIONS} and sms >= 1; got rows={rows}, hidden={hidden}, "
            f"projections={projections}, sms={sms}"
        )
    row_tiles = ceil_div(rows, BLOCK_M)
    col_tiles = ceil_div(hidden, BLOCK_N)
    k_blocks = ceil_div(hidden, BLOCK_K)
    tiles = projections * row_tiles * col_tiles
    splits = 1
    if split_k and tiles < sms:
        splits = max(1, min(sms // tiles, k_blocks // MIN_K_BLOCKS_PER_SPLIT))
    per_split = ceil_div(k_blocks, splits)
    splits = ceil_div(k_blocks, per_split)
    units = tiles * splits
    return GemmPlan(rows, hidden, projections, row_tiles, col_tiles, k_blocks, splits, per_split,
                    units, min(units, sms))


def uses_row_statistics(rows: int, hidden: int, streams: int, device: int) -> bool:
    """Whether collapse v3 takes its own path: only when v2 would not split K (for small M,
    splitting K to fill the GPU is worth more than the statistics); otherwise it is v2."""
    return plan_gemm(rows, hidden, streams - 1, _device.sm_count(device)).splits == 1


@dataclass(frozen=True)
class TensorMapSpec:
    """cuTensorMapEncodeTiled's arguments for a row-major bf16 [rows, cols] matrix read in boxes
    of [box_rows, BLOCK_K] with the 128-byte swizzle (innermost dimension first)."""

    global_dim: tuple[int, int]
    global_strides: tuple[int]  # bytes, dimensions 1.. only
    box_dim: tuple[int, int]
    element_strides: tuple[int, int]


def tensor_map_spec(rows: int, cols: int, box_rows: int) -> TensorMapSpec:
    """The box's inner extent, BLOCK_K bf16 = 128 bytes, is one swizzle row."""
    if cols % 8:
        raise ValueError(f"a TMA row must be a multiple of 16 bytes (cols divisible by 8), got cols={cols}")
    if not 1 <= box_rows <= 256:
        raise ValueError(f"a TMA box has 1..256 rows, got {box_rows}")
    return TensorMapSpec((cols, rows), (cols * 2,), (BLOCK_K, box_rows), (1, 1))


class TensorMapEncoder:
    """cuTensorMapEncodeTiled for one `TensorMapSpec`, its arguments converted once; a call returns
    the 128-byte CUtensorMap of the matrix at one device address (16-byte aligned)."""

    def __init__(self, spec: TensorMapSpec):
        from cuda.bindings import driver

        self.spec = spec
        self._encode = driver.cuTensorMapEncodeTiled
        self._success = driver.CUresult.CUDA_SUCCESS
        self._dtype = driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
        self._extents = ([driver.cuuint64_t(v) for v in spec.global_dim],
                         [driver.cuuint64_t(v) for v in spec.global_strides],
                         [driver.cuuint32_t(v) for v in spec.box_dim],
                         [driver.cuuint32_t(v) for v in spec.element_strides])
        self._modes = (driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
                       driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
                       driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                       driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)

    def __call__(self, address: int) -> bytes:
        error, tensor_map = self._encode(self._dtype, 2, address, *self._extents, *self._modes)
        if error != self._success:
            raise RuntimeError(f"cuTensorMapEncodeTiled({self.spec}) at {address:#x} failed: {error}")
        return ctypes.string_at(tensor_map.getPtr(), TENSOR_MAP_BYTES)


# The K splits' fp32 partials.
_SPLIT_PARTIALS = StreamScratch()


class HopperPlan:
    """One shape's collapse v2 or v3 on one device, called as every plan is (`_registry`): inputs
    (hidden_states, *weights), weights the stacked N-1 x H x H tensor or the N-1 H x H matrices;
    outputs (out,)."""

    def __init__(self, version: int, streams: int, rows: int, hidden: int, stacked: bool, device: int):
        sms = _device.sm_count(device)
        projections = streams - 1
        # The GEMM's epilogue mode: 0 (v2, and v3 where K is split), 1 (v3).
        self.mode = 1 if version == 3 and uses_row_statistics(rows, hidden, streams, device) else 0
        self.tiles = t = plan_gemm(rows, hidden, projections, sms, split_k=self.mode == 0)
        gemm = SOURCES[self.mode].kernel(_sources.collapse_gemm(self.mode))
        if gemm.max_dynamic_shared_size_bytes < SHARED_BYTES:
            gemm.max_dynamic_shared_size_bytes = SHARED_BYTES
        self.gemm = PackedLaunch(gemm, THREADS, SHARED_BYTES, (PARAMS,))
        self.tile_fields = (rows, hidden, projections, t.row_tiles, t.col_tiles, t.k_blocks, t.splits,
                            t.k_blocks_per_split, t.units)
        self.y_floats = projections * rows * hidden
        self.sumsq_floats = projections * rows * t.col_tiles
        if t.splits > 1:
            self.split_sum = PackedLaunch(_sources.COLLAPSE_V2.kernel("collapse_split_sum"), SPLIT_SUM_THREADS, 0,
                                          SPLIT_SUM_ARGS)
            self.split_sum_grid = min(ceil_div(self.y_floats // 4, SPLIT_SUM_THREADS), 8 * sms)
        if self.mode == 0:
            self.epilogue = epilogue_v1(streams, hidden)
        else:
            threads = min(_sources.COLLAPSE_V3_EPILOGUE_MAX_THREADS, max(32, round_up(hidden // 8, 32)))
            self.epilogue = PackedLaunch(_sources.COLLAPSE_V3.kernel(f"collapse_epilogue_v3<{streams}>"), threads, 0,
                                         EPILOGUE_V3_ARGS)
        self.x_map = TensorMapEncoder(tensor_map_spec(rows, hidden, BLOCK_M))
        self.w_map = TensorMapEncoder(tensor_map_spec(hidden, hidden, BLOCK_N))
        self.rows, self.hidden, self.projections, self.stacked = rows, hidden, projections, stacked
        # (address, packed maps) of the last call's hidden states and weights.
        self._x_maps: tuple = (None, b"")
        self._w_maps: tuple = (None, b"")

    def _maps(self, hidden_states: torch.Tensor, weights: Sequence[torch.Tensor]) -> tuple[bytes, bytes]:
        """The x and w tensor maps of these operands, encoded again only where an address changed."""
        address, x_maps = self._x_maps
        hs = hidden_states.data_ptr()
        if address != hs:
            stream_bytes = 2 * self.rows * self.hidden
            x_maps = b"".join(self.x_map(hs + (k + 1) * stream_bytes) for k in range(self.projections))
            self._x_maps = (hs, x_maps)
        address, w_maps = self._w_maps
        w = weights[0].data_ptr() if self.stacked else tuple(m.data_ptr() for m in weights)
        if address != w:
            # TMA reads a matrix from a 16-byte aligned address; the op checked hidden_states'.
            names = ["unembed_projs"] if self.stacked else [f"unembed_projs[{k}]" for k in range(self.projections)]
            _arrays.check_aligned(list(zip(names, weights)))
            matrix_bytes = 2 * self.hidden * self.hidden
            starts = [w + k * matrix_bytes for k in range(self.projections)] if self.stacked else w
            w_maps = b"".join(self.w_map(start) for start in starts)
            self._w_maps = (w, w_maps)
        return x_maps, w_maps

    def project(self, hidden_states: torch.Tensor, weights: Sequence[torch.Tensor], y: torch.Tensor,
                row_sumsq: torch.Tensor | None, stream: int, reuse_scratch: bool) -> None:
        """The GEMM: y (fp32 [N-1, M, H]) and, in mode 1, row_sumsq (fp32 [N-1, M, column
        tiles]), with the K splits summed."""
        x_maps, w_maps = self._maps(hidden_states, weights)
        y_ptr = y.data_ptr()
        sumsq_ptr = 0 if row_sumsq is None else row_sumsq.data_ptr()
        t = self.tiles
        if t.splits == 1:
            self.gemm(stream, t.grid, x_maps, w_maps, y_ptr, sumsq_ptr, *self.tile_fields)
            return
        # Held until both launches are queued: freed earlier, it could be handed out again.
        partials, key = _SPLIT_PARTIALS.take(4 * t.splits * self.y_floats, hidden_states.device, stream, reuse_scratch)
        self.gemm(stream, t.grid, x_maps, w_maps, partials.data_ptr(), sumsq_ptr, *self.tile_fields)
        self.split_sum(stream, self.split_sum_grid, partials.data_ptr(), y_ptr, t.splits, self.y_floats // 4)
        _SPLIT_PARTIALS.give_back(partials, key)

    def __call__(self, inputs: tuple[torch.Tensor, ...], outputs: tuple[torch.Tensor], scalars: tuple[float],
                 stream: int, reuse_scratch: bool) -> None:
        hidden_states, *weights = inputs
        out, = outputs
        eps, = scalars
        device = hidden_states.device
        hs, out_ptr, rows = hidden_states.data_ptr(), out.data_ptr(), self.rows
        y = torch.empty(self.y_floats, dtype=torch.float32, device=device)
        if self.mode == 0:
            self.project(hidden_states, weights, y, None, stream, reuse_scratch)
            self.epilogue(stream, rows, hs, y.data_ptr(), out_ptr, self.hidden, rows, eps)
            return
        row_sumsq = torch.empty(self.sumsq_floats, dtype=torch.float32, device=device)
        self.project(hidden_states, weights, y, row_sumsq, stream, reuse_scratch)
        self.epilogue(stream, rows, hs, y.data_ptr(), row_sumsq.data_ptr(), out_ptr, self.hidden, rows,
                      self.tiles.col_tiles, eps)


@functools.lru_cache(maxsize=256)
def plan(version: int, streams: int, rows: int, hidden: int, stacked: bool, device: int) -> HopperPlan:
    """The plan of collapse `version` (2 or 3) for one shape, built once."""
    with torch.cuda.device(device):
        return HopperPlan(version, streams, rows, hidden, stacked, device)
