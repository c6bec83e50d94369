"""The collapse forward on Hopper (sm_90a): the projections by this package's own GEMM.

v2: `collapse_gemm_sm90<false>` (kernels/collapse_v2.cu) computes y_k = x_k @ W_k^T for all N-1
streams in one persistent launch (TMA tile loads into a 4-stage shared-memory ring, wgmma on two
consumer warpgroups, a producer warpgroup); when M is small the K dimension is split so that
every SM streams its share of the weights, and `collapse_split_sum` adds the splits' fp32
partials in a fixed order. The magnitude epilogue is v1's (`collapse_epilogue_v1`).
v3: the same GEMM (`collapse_gemm_sm90<true>`) also writes each row's sum of squares per column
tile from its fp32 accumulators (fixed order, no atomics), so `collapse_epilogue_v3` needs no
reduction over y_k and reads it once, streamed. It applies when K is not split (M large enough
to fill the GPU with output tiles); otherwise collapse_v3 is collapse_v2.
v4: `collapse_gemm_sm90<2>` orders the units row block first and counts each row block's finished
units; the CTA that finishes the last one applies the normalisation to those 128 rows while their
y_k are still in L2 and writes the bf16 output (one launch, no epilogue pass over HBM). Same
K-split rule as v3.

The kernels are launched through the CUDA driver (cuda-bindings) because their parameter is one
struct holding the TMA tensor maps (`CollapseGemmParams`), passed by value. Launchers take torch
CUDA tensors and a raw CUDA stream handle; per-shape plans, tensor maps and workspaces are cached.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .. import _arrays, _device, _sources
from .._build import KernelSource, compile_offline
from .._scratch import StreamScratch
from .._sources import COLLAPSE_V1 as EPILOGUE_V1_SOURCE
from .._sources import COLLAPSE_V2 as SOURCE
from .collapse_versions import epilogue_launch_shape

BF16, F32 = torch.bfloat16, torch.float32

ARCH = "sm_90a"
# collapse_gemm_sm90<MODE>: kStoreY = 0 (v2), kStoreYStats = 1 (v3), kFused = 2 (v4).
GEMM_V2 = "collapse_gemm_sm90<0>"
GEMM_V3 = "collapse_gemm_sm90<1>"
GEMM_V4 = "collapse_gemm_sm90<2>"
SPLIT_SUM = "collapse_split_sum"

_TILE = _sources.COLLAPSE_V2_TILE
BLOCK_M, BLOCK_N, BLOCK_K = _TILE["COLLAPSE_V2_BLOCK_M"], _TILE["COLLAPSE_V2_BLOCK_N"], _TILE["COLLAPSE_V2_BLOCK_K"]
STAGES = _TILE["COLLAPSE_V2_STAGES"]
THREADS = 128 * (1 + _TILE["COLLAPSE_V2_CONSUMERS"])  # a producer warpgroup and the consumers
# The ring (aligned for the swizzle), its full and empty barriers, and v4's flag (kSharedBytes).
SHARED_BYTES = _TILE["COLLAPSE_V2_SWIZZLE_ALIGN"] + STAGES * (BLOCK_M + BLOCK_N) * BLOCK_K * 2 + 2 * STAGES * 8 + 16
MAX_PROJECTIONS = _TILE["COLLAPSE_V2_MAX_PROJECTIONS"]
TENSOR_MAP_BYTES = 128
# Byte offsets of CollapseGemmParams' fields (the kernel's static_asserts pin the same numbers).
PARAM_OFFSETS = {
    "x_maps": 0, "w_maps": 384, "out": 768, "row_sumsq": 776, "rows": 784, "hidden": 792,
    "projections": 796, "row_tiles": 800, "col_tiles": 804, "k_blocks": 808, "splits": 812,
    "k_blocks_per_split": 816, "units": 820, "stream0": 824, "out_bf16": 832, "row_counters": 840,
    "eps": 848,
}
PARAMS_BYTES = 896
# A K split streams at least this many 64-wide K blocks, so the per-unit pipeline fill and the
# partial's write stay small next to its loads.
MIN_K_BLOCKS_PER_SPLIT = 4
SPLIT_SUM_THREADS = 256
EPILOGUE_V3_MAX_THREADS = _TILE["COLLAPSE_V3_EPILOGUE_MAX_THREADS"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


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
    row_tiles = _ceil_div(rows, BLOCK_M)
    col_tiles = _ceil_div(hidden, BLOCK_N)
    k_blocks = _ceil_div(hidden, BLOCK_K)
    tiles = projections * row_tiles * col_tiles
    splits = 1
    if split_k and tiles < sms:
        splits = max(1, min(sms // tiles, k_blocks // MIN_K_BLOCKS_PER_SPLIT))
    per_split = _ceil_div(k_blocks, splits)
    splits = _ceil_div(k_blocks, per_split)
    units = tiles * splits
    return GemmPlan(rows, hidden, projections, row_tiles, col_tiles, k_blocks, splits, per_split,
                    units, min(units, sms))


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


def encode_tensor_map(address: int, spec: TensorMapSpec) -> bytes:
    """The 128-byte CUtensorMap of `spec` at device address `address` (16-byte aligned)."""
    from cuda.bindings import driver

    if address % 16:
        raise ValueError(f"a TMA tensor must start at a 16-byte aligned address, got {address:#x}")
    error, tensor_map = driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, address,
        [driver.cuuint64_t(v) for v in spec.global_dim],
        [driver.cuuint64_t(v) for v in spec.global_strides],
        [driver.cuuint32_t(v) for v in spec.box_dim],
        [driver.cuuint32_t(v) for v in spec.element_strides],
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    _check(error, f"cuTensorMapEncodeTiled({spec})")
    return ctypes.string_at(tensor_map.getPtr(), TENSOR_MAP_BYTES)


@dataclass(frozen=True)
class FusedEpilogue:
    """What v4's in-GEMM epilogue needs: device addresses and epsilon."""

    stream0_ptr: int  # hidden_states[0], bf16 [M, H]
    out_ptr: int  # bf16 [M, H]
    row_counters_ptr: int  # uint32 [row tiles], zeros
    eps: float


def pack_params(x_maps: Sequence[bytes], w_maps: Sequence[bytes], out_ptr: int, row_sumsq_ptr: int,
                plan: GemmPlan, fused: FusedEpilogue | None = None) -> bytes:
    """CollapseGemmParams as the kernel lays it out (unused map slots and, without `fused`, the
    fused epilogue's fields are zeros: never read)."""
    if len(x_maps) != plan.projections or len(w_maps) != plan.projections:
        raise ValueError(f"need {plan.projections} x and w tensor maps, got {len(x_maps)} and {len(w_maps)}")
    buffer = bytearray(PARAMS_BYTES)
    for slot, (x_map, w_map) in enumerate(zip(x_maps, w_maps)):
        if len(x_map) != TENSOR_MAP_BYTES or len(w_map) != TENSOR_MAP_BYTES:
            raise ValueError("tensor maps are 128 bytes each")
        x_at = PARAM_OFFSETS["x_maps"] + slot * TENSOR_MAP_BYTES
        w_at = PARAM_OFFSETS["w_maps"] + slot * TENSOR_MAP_BYTES
        buffer[x_at:x_at + TENSOR_MAP_BYTES] = x_map
        buffer[w_at:w_at + TENSOR_MAP_BYTES] = w_map
    struct.pack_into("<QQq", buffer, PARAM_OFFSETS["out"], out_ptr, row_sumsq_ptr, plan.rows)
    struct.pack_into(
        "<8i", buffer, PARAM_OFFSETS["hidden"], plan.hidden, plan.projections, plan.row_tiles,
        plan.col_tiles, plan.k_blocks, plan.splits, plan.k_blocks_per_split, plan.units,
    )
    if fused is not None:
        struct.pack_into("<QQQf", buffer, PARAM_OFFSETS["stream0"], fused.stream0_ptr, fused.out_ptr,
                         fused.row_counters_ptr, fused.eps)
    return bytes(buffer)


# ---- driver plumbing ------------------------------------------------------------------------------

def _check(result, what: str):
    from cuda.bindings import driver

    error = result[0] if isinstance(result, tuple) else result
    if error != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {error}")
    return result[1:] if isinstance(result, tuple) else ()


_cubins: dict = {}


def _cubin(source: KernelSource):
    """The source's sm_90a cubin, compiled once per process."""
    build = _cubins.get(source.filename)
    if build is None:
        build = _cubins[source.filename] = compile_offline(source, ARCH)
    return build


_modules: dict = {}  # (filename, device) -> CUmodule
_functions: dict = {}  # (filename, expression, device) -> CUfunction
_contexts: dict = {}  # device -> its primary CUcontext
_modules_lock = threading.Lock()


def _make_current(device: int) -> None:
    """Make the device's primary context (the one torch and CuPy use) current on this thread."""
    from cuda.bindings import driver

    context = _contexts.get(device)
    if context is None:
        _check(driver.cuInit(0), "cuInit")
        (dev,) = _check(driver.cuDeviceGet(device), "cuDeviceGet")
        (context,) = _check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        _contexts[device] = context
    _check(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")


def _function(source: KernelSource, expression: str, device: int, shared_bytes: int = 0):
    """The driver function of `expression` in `source`, loaded once per device."""
    from cuda.bindings import driver

    key = (source.filename, expression, device)
    function = _functions.get(key)
    if function is None:
        with _modules_lock:
            _make_current(device)
            build = _cubin(source)
            module_key = (source.filename, device)
            module = _modules.get(module_key)
            if module is None:
                (module,) = _check(driver.cuModuleLoadData(build.cubin), f"cuModuleLoadData({source.filename})")
                _modules[module_key] = module
            (function,) = _check(
                driver.cuModuleGetFunction(module, build.lowered_names[expression].encode()),
                f"cuModuleGetFunction({expression})",
            )
            if shared_bytes:
                _check(driver.cuFuncSetAttribute(
                    function, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared_bytes), f"cuFuncSetAttribute({expression}, {shared_bytes} bytes shared)")
            _functions[key] = function
    return function


def _launch(function, device: int, grid: int, threads: int, shared_bytes: int, stream: int,
            args: Sequence[Any], what: str) -> None:
    """cuLaunchKernel with each argument given as a ctypes object (copied by the driver)."""
    from cuda.bindings import driver

    _make_current(device)
    pointers = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
    _check(driver.cuLaunchKernel(function, grid, 1, 1, threads, 1, 1, shared_bytes,
                                 driver.CUstream(stream), ctypes.addressof(pointers), 0), what)


# ---- v2 launchers ---------------------------------------------------------------------------------

class _Operand:
    """A validated tensor and its address (what the launchers read of it)."""

    def __init__(self, t: torch.Tensor):
        self.tensor, self.shape, self.ptr = t, tuple(t.shape), t.data_ptr()


def _accept(name: str, t: Any, dtype, shape, dims: str) -> _Operand:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch CUDA tensor, got {type(t).__name__}")
    _arrays.check_tensor(name, t, dtype, shape, dims)
    if t.is_cuda:
        _arrays.check_aligned([(name, t)])
    return _Operand(t)


def _stream_operands(hidden_states: Any, weights: Any):
    """Validated (hidden_states, weight addresses, N, M, H, device index)."""
    shape = getattr(hidden_states, "shape", None)
    if shape is None:
        raise TypeError(f"hidden_states must be a torch CUDA tensor, got {type(hidden_states).__name__}")
    if len(shape) not in (3, 4):
        raise ValueError(f"hidden_states must be [N, B, S, H] or [N, M, H], got {list(shape)}")
    hs = _accept("hidden_states", hidden_states, BF16, (None,) * len(shape), "N B S H" if len(shape) == 4 else "N M H")
    streams, hidden = hs.shape[0], hs.shape[-1]
    rows = 1
    for extent in hs.shape[1:-1]:
        rows *= extent
    _arrays.check_streams_and_width("hidden_states", streams, hidden, "last dim")
    if isinstance(weights, (list, tuple)):
        if len(weights) != streams - 1:
            raise ValueError(f"weights must hold N-1 = {streams - 1} matrices, got {len(weights)}")
        mats = [_accept(f"weights[{i}]", w, BF16, (hidden, hidden), "H H") for i, w in enumerate(weights)]
        w_ptrs = [m.ptr for m in mats]
    else:
        mats = [_accept("weights", weights, BF16, (streams - 1, hidden, hidden), "N-1 H H")]
        w_ptrs = [mats[0].ptr + 2 * k * hidden * hidden for k in range(streams - 1)]
    device = _arrays.check_devices([("hidden_states", hs.tensor)] + [(f"weights[{i}]", m.tensor) for i, m in enumerate(mats)])
    if device.type != "cuda":
        raise ValueError(f"hidden_states is on {device}; expected a CUDA device")
    return hs, w_ptrs, streams, rows, hidden, device.index


@dataclass
class _Prepared:
    plan: GemmPlan
    x_maps: list
    w_maps: list


_prepared: dict = {}
_PREPARED_LIMIT = 64


def _prepare(hs_ptr: int, w_ptrs: Sequence[int], streams: int, rows: int, hidden: int, device: int,
             split_k: bool) -> _Prepared:
    """The plan and tensor maps of these operands (cached by shape and addresses)."""
    key = (device, hs_ptr, tuple(w_ptrs), streams, rows, hidden, split_k)
    prepared = _prepared.get(key)
    if prepared is None:
        plan = plan_gemm(rows, hidden, streams - 1, _device.sm_count(device), split_k)
        x_spec = tensor_map_spec(rows, hidden, BLOCK_M)
        w_spec = tensor_map_spec(hidden, hidden, BLOCK_N)
        stream_bytes = 2 * rows * hidden
        x_maps = [encode_tensor_map(hs_ptr + (k + 1) * stream_bytes, x_spec) for k in range(streams - 1)]
        w_maps = [encode_tensor_map(p, w_spec) for p in w_ptrs]
        if len(_prepared) >= _PREPARED_LIMIT:
            _prepared.clear()
        prepared = _prepared[key] = _Prepared(plan, x_maps, w_maps)
    return prepared


# The K splits' fp32 partials, and v4's per-row-block unit counters (zeroed; the kernel leaves
# every counter at zero when it finishes).
_SPLIT_PARTIALS = StreamScratch()
_ROW_COUNTERS = StreamScratch(zeroed=True)


def _run_gemm(hidden_states: Any, weights: Any, out_y: Any, out_row_sumsq: Any, stream: int,
              fused: FusedEpilogue | None = None) -> GemmPlan | None:
    """v2 (out_row_sumsq None: K split when M is small), v3 (row statistics, K never split) or,
    with `fused`, v4 (v3 plus the collapse of each finished row block)."""
    hs, w_ptrs, streams, rows, hidden, device = _stream_operands(hidden_states, weights)
    y = _accept("out_y", out_y, F32, (streams - 1, *hs.shape[1:]), "N-1 ...")
    stats = out_row_sumsq is not None
    if fused is not None and not stats:
        raise ValueError("the fused epilogue (v4) needs out_row_sumsq")
    if rows == 0:
        return None
    prepared = _prepare(hs.ptr, w_ptrs, streams, rows, hidden, device, split_k=not stats)
    plan = prepared.plan
    checked = [hs, y]
    if stats:
        row_sumsq = _accept("out_row_sumsq", out_row_sumsq, F32, (streams - 1, rows, plan.col_tiles), "N-1 M C")
        checked.append(row_sumsq)
    _arrays.check_devices([(str(i), c.tensor) for i, c in enumerate(checked)])
    expression = GEMM_V4 if fused is not None else GEMM_V3 if stats else GEMM_V2
    gemm = _function(SOURCE, expression, device, SHARED_BYTES)
    slab = (streams - 1) * rows * hidden
    split_partials = None  # held until the launches are queued
    if plan.splits == 1:
        target = y.ptr
    else:
        split_partials = _SPLIT_PARTIALS.get(4 * plan.splits * slab, torch.device("cuda", device), stream)
        target = split_partials.data_ptr()
    packed = pack_params(prepared.x_maps, prepared.w_maps, target, row_sumsq.ptr if stats else 0, plan, fused)
    params = ctypes.create_string_buffer(packed, PARAMS_BYTES)
    _launch(gemm, device, plan.grid, THREADS, SHARED_BYTES, stream, [params], expression)
    if plan.splits > 1:
        count = slab // 4
        blocks = min(_ceil_div(count, SPLIT_SUM_THREADS), 8 * _device.sm_count(device))
        _launch(_function(SOURCE, SPLIT_SUM, device), device, blocks, SPLIT_SUM_THREADS, 0, stream,
                [ctypes.c_uint64(target), ctypes.c_uint64(y.ptr), ctypes.c_int32(plan.splits),
                 ctypes.c_int64(count)], SPLIT_SUM)
    return plan


def launch_v2(hidden_states: Any, weights: Any, out_y: Any, stream: int) -> GemmPlan | None:
    """out_y[k] = hidden_states[k + 1] @ weights[k]^T (fp32) for k < N-1, on CUDA stream `stream`.

    hidden_states: bf16 [N, B, S, H] or [N, M, H]; weights: N-1 bf16 [H, H] (a list, or stacked
    [N-1, H, H]); out_y: fp32 [N-1, M, H] (or [N-1, B, S, H]), overwritten. Returns the plan used
    (None when M = 0: nothing to do).
    """
    return _run_gemm(hidden_states, weights, out_y, None, stream)


def launch_v3(hidden_states: Any, weights: Any, out_y: Any, out_row_sumsq: Any, stream: int) -> GemmPlan | None:
    """launch_v2 without K splits, plus out_row_sumsq[k, t, c] = sum of out_y[k, t, j]^2 over the
    columns j of column tile c (fp32 [N-1, M, ceil(H / BLOCK_N)])."""
    return _run_gemm(hidden_states, weights, out_y, out_row_sumsq, stream)


def uses_row_statistics(rows: int, hidden: int, streams: int, device: int) -> bool:
    """Whether collapse_v3/v4 take their own path: only when v2 would not split K (for small M,
    splitting K to fill the GPU is worth more than the statistics); otherwise they are v2."""
    return plan_gemm(rows, hidden, streams - 1, _device.sm_count(device)).splits == 1


def _collapse(hidden_states: Any, weights: Any, eps: float, version: int, out: Any = None) -> Any:
    hs, _, streams, rows, hidden, device = _stream_operands(hidden_states, weights)
    eps = _arrays.positive_finite("eps", eps)
    if out is None:
        out = torch.empty(hs.shape[1:], dtype=torch.bfloat16, device=hidden_states.device)
    if rows == 0:
        return out
    stream = torch.cuda.current_stream(device).cuda_stream
    y = torch.empty((streams - 1, rows, hidden), dtype=torch.float32, device=hidden_states.device)
    x = hidden_states.view(streams, rows, hidden)
    if version == 2 or not uses_row_statistics(rows, hidden, streams, device):
        launch_v2(x, weights, y, stream)
        chunks, threads = epilogue_launch_shape(streams, hidden)
        epilogue = _function(EPILOGUE_V1_SOURCE, f"collapse_epilogue_v1<{streams}, {chunks}>", device)
        args = [ctypes.c_uint64(hs.ptr), ctypes.c_uint64(y.data_ptr()), ctypes.c_uint64(out.data_ptr()),
                ctypes.c_int32(hidden), ctypes.c_int64(rows), ctypes.c_float(eps)]
        # One block per row: the grid's x extent allows 2^31 - 1 rows.
        _launch(epilogue, device, rows, threads, 0, stream, args, "collapse_epilogue_v1")
        return out
    col_tiles = _ceil_div(hidden, BLOCK_N)
    row_sumsq = torch.empty((streams - 1, rows, col_tiles), dtype=torch.float32, device=hidden_states.device)
    if version == 4:
        counters = _ROW_COUNTERS.get(4 * _ceil_div(rows, BLOCK_M), torch.device("cuda", device), stream)
        _run_gemm(x, weights, y, row_sumsq, stream, FusedEpilogue(hs.ptr, out.data_ptr(), counters.data_ptr(), eps))
        return out
    launch_v3(x, weights, y, row_sumsq, stream)
    epilogue = _function(SOURCE, f"collapse_epilogue_v3<{streams}>", device)
    threads = min(EPILOGUE_V3_MAX_THREADS, max(32, _ceil_div(hidden // 8, 32) * 32))
    args = [ctypes.c_uint64(hs.ptr), ctypes.c_uint64(y.data_ptr()), ctypes.c_uint64(row_sumsq.data_ptr()),
            ctypes.c_uint64(out.data_ptr()), ctypes.c_int32(hidden), ctypes.c_int64(rows),
            ctypes.c_int32(col_tiles), ctypes.c_float(eps)]
    _launch(epilogue, device, rows, threads, 0, stream, args, "collapse_epilogue_v3")
    return out


def collapse_v2(hidden_states: Any, weights: Any, eps: float = 1e-5) -> Any:
    """The collapse (SPEC section 1) with v2's projections and v1's epilogue: bf16 [B, S, H].

    hidden_states bf16 [N, B, S, H]; weights N-1 bf16 [H, H] (list or stacked). Runs on torch's
    current stream of the tensors' device.
    """
    return _collapse(hidden_states, weights, eps, version=2)


def collapse_v3(hidden_states: Any, weights: Any, eps: float = 1e-5) -> Any:
    """As collapse_v2, with the projections' row statistics taken from the GEMM's accumulators
    (collapse_epilogue_v3 reads each y_k once, streamed) whenever K is not split."""
    return _collapse(hidden_states, weights, eps, version=3)


def collapse_v4(hidden_states: Any, weights: Any, eps: float = 1e-5) -> Any:
    """As collapse_v3, with the normalisation done inside the GEMM by the CTA that finishes each
    row block (y_k read back from L2; one launch) whenever K is not split."""
    return _collapse(hidden_states, weights, eps, version=4)
