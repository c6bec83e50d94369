"""The CUDA side of Gemma 3n's AltUp steps: kernel sources and launchers on torch CUDA tensors.

Each launcher takes bf16 CUDA tensors already validated by `gemma3n_altup` (contiguous, 16-byte
aligned rows, H % 8 == 0, 2 <= N <= 4) and runs on torch's current stream of the tensors'
device. Each step runs a launch plan built once per shape (`row_forward_plan`, `routed_backward_plan`,
`expand_plan`, ...): its packed launches, grids, cuBLASLt GEMMs and scratch layout fixed, so a call
allocates its outputs, looks the plan up once and stores addresses; plans are called as the
benchmark ops' are (`ops/_registry`). The GEMMs of the expansion and collapse run in cuBLASLt
(`_cublas`, called on addresses, so a call builds no tensor views): bf16 inputs and fp32
accumulation, the projections written in fp32 (never rounded before the epilogue) and the
gradients rounded to bf16 once. Each call's intermediates share one scratch allocation. The
predict and correct backward write their weight gradients per block; `altup_router_grads_v1` sums
them in a fixed order and finishes them in bf16: every result is bitwise deterministic.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import torch

from .. import _cublas, _device, _sources
from .._build import KernelSource
from .._launch import PackedLaunch, ceil_div, round_up
from .._scratch import StreamScratch

STREAMS = _sources.SUPPORTED_STREAMS
MAX_HIDDEN = 8 * _sources.ROW_THREADS_MAX  # one block per token holds a row in H / 8 threads
# Offsets within one call's scratch allocation (cuBLASLt wants 256-byte aligned operands for its
# fastest kernels).
SCRATCH_ALIGNMENT = 256
# Blocks of the backward kernels per SM: two are resident at N = 4 and H <= 2048 (at most 128
# registers a thread), and the weight-gradient partials (one row per block) stay small.
BACKWARD_BLOCKS_PER_SM = 2
# What a resident block of the predict or correct backward takes of an SM's shared memory besides
# its weight-gradient sums: its static arrays (under 3 KiB at N = 4) and the 1 KiB the driver
# reserves per block.
ROUTED_BACKWARD_OTHER_SHARED = 4 * 1024


class PredictGradients(NamedTuple):
    grad_hidden_states: torch.Tensor  # bf16 [N, B, S, H]
    grad_prediction_coefs: torch.Tensor  # bf16 [N*N, N]
    grad_router_weight: torch.Tensor  # bf16 [N, H]
    grad_norm_weight: torch.Tensor  # bf16 [H]


class CorrectGradients(NamedTuple):
    grad_predictions: torch.Tensor  # bf16 [N, B, S, H]
    grad_activated: torch.Tensor  # bf16 [B, S, H]
    grad_correction_coefs: torch.Tensor  # bf16 [N, N]
    grad_router_weight: torch.Tensor  # bf16 [N, H]
    grad_norm_weight: torch.Tensor  # bf16 [H]


def _addresses(*tensors: torch.Tensor | None) -> tuple[int, ...]:
    """The device addresses of `tensors`, the kernels' pointer arguments (None: a null pointer, an
    optional argument left out)."""
    return tuple(0 if t is None else t.data_ptr() for t in tensors)


def _row_threads(hidden: int) -> int:
    """H / 8 threads rounded up to whole warps, and at least N^3 <= 64: in the predict backward
    thread e accumulates the prediction-coefficient gradient entry e."""
    return max(64, (hidden // 8 + 31) // 32 * 32)


# The argument lists of the kernels, as `_launch.ARG_CODES` types: fixed per kernel, so a call
# builds no key from its arguments.
_PTR = ("ptr",)
_CPP_BOOL = {False: "false", True: "true"}  # a bool template argument as the instance names spell it
_FORWARD_TAIL = ("i64", "i32", "f32", "f32")  # tokens, hidden, eps, router scale
_BACKWARD_TAIL = ("i64", "i64", "i32", "f32", "f32")  # partial stride, tokens, hidden, eps, router scale


def _row_major_sums(streams: int, hidden: int) -> int:
    """Bytes of a routed backward's weight-gradient sums laid out row-major: N * H floats."""
    return 4 * streams * hidden


def _slice_major_sums(streams: int, hidden: int) -> int:
    """Bytes of the sums laid out slice-major: 8 N planes of ROW_THREADS_MAX floats (kernels/altup_rows.cuh)."""
    return 4 * streams * 8 * _sources.ROW_THREADS_MAX


class RowKernel(NamedTuple):
    """One version of one step's kernel: its source (kernels/<template>.cu, the version's own
    file), its template, its argument types and one line on what the version changed; a routed
    backward's also the dynamic shared memory of its weight-gradient sums, (N, H) -> bytes. A
    version the default beats at every recorded size says why it stays (`kept_because`, as the
    benchmark ops' `Version`s do; tests/test_registry.py checks it against gemma3n_kernels.csv).
    A new version of a step is a new entry at the end of the step's tuple in `KERNELS`, with its
    `.cu` and its `KernelSource` in `_sources`."""
    source: KernelSource
    template: str
    arg_types: tuple[str, ...]
    note: str
    weight_sums_bytes: Callable[[int, int], int] | None = None
    kept_because: str = ""

    def instance(self, params: tuple) -> str:
        """The name expression of the instantiation <params...> (as `_sources` lists it)."""
        return f"{self.template}<{', '.join(map(str, params))}>"


def _kernel(source: KernelSource, arg_types: tuple[str, ...], note: str,
            weight_sums_bytes: Callable[[int, int], int] | None = None, kept_because: str = "") -> RowKernel:
    """A version whose kernel is named after its file."""
    return RowKernel(source, source.filename.removesuffix(".cu"), arg_types, note, weight_sums_bytes, kept_because)


_PREDICT_BACKWARD_ARGS = _PTR * 8 + _BACKWARD_TAIL
_CORRECT_BACKWARD_ARGS = _PTR * 10 + _BACKWARD_TAIL
_MAGNITUDE_MATCH_BACKWARD_ARGS = _PTR * 5 + ("i64", "f32", "i64", "i64", "i32", "f32")
_ROW_MAJOR_FALLBACK = ("the default where slice-major sums would leave one block an SM: N = 4 on GPUs with 100 KiB "
                       "of shared memory an SM (sm_86, sm_89)")

# Each step's versions, oldest first (the header of each .cu says more). The operators use
# `DEFAULT`'s, or where `_routed_default` picks an older predict or correct backward for the GPU at
# hand, that one. Template arguments: the forwards <N, active index>, the routed
# backwards <N, active index, grad_active given>, router_grads and expand_forward <N>, the
# magnitude-match backward <N, the base row gradient's type>.
KERNELS = {
    "predict_forward": (
        _kernel(_sources.ALTUP_PREDICT_FORWARD_V1, _PTR * 6 + _FORWARD_TAIL,
                "one block per token: its N rows read once, N predictions written once"),),
    "predict_backward": (
        _kernel(_sources.ALTUP_PREDICT_BACKWARD_V1, _PREDICT_BACKWARD_ARGS,
                "weight-gradient sums row-major in shared memory (8-way bank conflicts), g reloaded through L1",
                _row_major_sums, _ROW_MAJOR_FALLBACK),
        _kernel(_sources.ALTUP_PREDICT_BACKWARD_V2, _PREDICT_BACKWARD_ARGS,
                "weight-gradient sums slice-major: no bank conflict", _slice_major_sums,
                "teaching step: the sums' layout alone, before v3 packs the token's rows"),
        _kernel(_sources.ALTUP_PREDICT_BACKWARD_V3, _PREDICT_BACKWARD_ARGS,
                "the token's rows of h and g packed in registers: g read once", _slice_major_sums),
        _kernel(_sources.ALTUP_PREDICT_BACKWARD_V4, _PREDICT_BACKWARD_ARGS,
                "the block's next token's rows loaded while this one is worked on", _slice_major_sums)),
    "correct_forward": (
        _kernel(_sources.ALTUP_CORRECT_FORWARD_V1, _PTR * 7 + _FORWARD_TAIL,
                "one block per token: N predictions and x read once, N rows written once"),),
    "correct_backward": (
        _kernel(_sources.ALTUP_CORRECT_BACKWARD_V1, _CORRECT_BACKWARD_ARGS,
                "weight-gradient sums row-major in shared memory (8-way bank conflicts)", _row_major_sums,
                _ROW_MAJOR_FALLBACK),
        _kernel(_sources.ALTUP_CORRECT_BACKWARD_V2, _CORRECT_BACKWARD_ARGS,
                "weight-gradient sums slice-major: no bank conflict", _slice_major_sums),
        _kernel(_sources.ALTUP_CORRECT_BACKWARD_V3, _CORRECT_BACKWARD_ARGS,
                "the token's rows packed in registers, the block's next token's loaded while this one is worked on",
                _slice_major_sums)),
    "router_grads": (
        _kernel(_sources.ALTUP_ROUTER_GRADS_V1, ("ptr", "i32", "i64", "i32", "i32", "ptr", "ptr", "f32", "ptr", "ptr",
                                                 "ptr"),
                "the backwards' per-block partials summed in block order, finished in bf16"),),
    "expand_forward": (
        _kernel(_sources.ALTUP_EXPAND_FORWARD_V1, _PTR * 3 + ("i64", "i64", "i64", "i32", "f32"),
                "the magnitude match after the projection GEMMs, one block per token"),),
    "magnitude_match_backward": (
        _kernel(_sources.ALTUP_MAGNITUDE_MATCH_BACKWARD_V1, _MAGNITUDE_MATCH_BACKWARD_ARGS,
                "every row of the token unpacked in registers: 2 blocks an SM at H = 2048",
                kept_because="teaching step: the unpacked baseline that v2's packing is measured against"),
        _kernel(_sources.ALTUP_MAGNITUDE_MATCH_BACKWARD_V2, _MAGNITUDE_MATCH_BACKWARD_ARGS,
                "the bf16 rows kept packed in registers: 3 blocks an SM at H = 2048")),
}
# The default version of each step (numbers count from 1): the newest, unless a newer one has yet to
# win a recorded run (tests/test_registry.py holds every registered version to the recorded one).
# The predict backward's v4 and the correct backward's v3 have not won a run: on an H100 (1ae0df0,
# results/nvidia-h100-80gb-hbm3/) predict v4 was slower than v3 at every M and correct v3 within 2%
# of v2; v3 and v2 stay the defaults until an H200 run of scripts/bench_gemma3n.py shows otherwise.
DEFAULT = {**{step: len(versions) for step, versions in KERNELS.items()}, "predict_backward": 3, "correct_backward": 2}


def check_version(step: str, version: int | None) -> int:
    """`version`, or the step's default for None; a ValueError names the versions there are."""
    if version is None:
        return DEFAULT[step]
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= len(KERNELS[step]):
        raise ValueError(f"{step}: version must be one of {list(range(1, len(KERNELS[step]) + 1))}, got {version!r}")
    return version


@functools.lru_cache(maxsize=None)
def _row_launch(step: str, version: int, params: tuple, device: int, threads: int, shared_mem: int = 0) -> PackedLaunch:
    """The packed launch of version `version` of KERNELS[step]<params> on CUDA device `device`,
    built once; plans hold theirs, so a call looks up nothing."""
    with _device.on(device):
        entry = KERNELS[step][version - 1]
        kernel = entry.source.kernel(entry.instance(params))
        if shared_mem > kernel.max_dynamic_shared_size_bytes:
            kernel.max_dynamic_shared_size_bytes = shared_mem
        return PackedLaunch(kernel, threads, shared_mem, entry.arg_types)


def _stream(device: int) -> int:
    """torch's current stream of CUDA device `device`, as a raw handle (a capture of that stream
    captures the launches)."""
    return torch._C._cuda_getCurrentRawStream(device)


# ---- launch plans: one per step and shape, called as every plan of the package is (ops/_registry):
#      plan(inputs, outputs, scalars, stream, reuse_scratch)

class RowForwardPlan:
    """The predict or correct forward at one shape: one block per token. inputs: predict (hidden
    states, P, R, w), correct (predictions, activated, Q, R, w); outputs: (the N streams, the copy of
    the active row or None); scalars: (eps, router_scale)."""

    def __init__(self, step: str, streams: int, active: int, tokens: int, hidden: int, device: int):
        self.launch = _row_launch(step, 1, (streams, active), device, _row_threads(hidden))
        self.tokens, self.hidden = tokens, hidden

    def __call__(self, inputs, outputs, scalars, stream: int, reuse_scratch: bool = False) -> None:
        self.launch(stream, self.tokens, *_addresses(*inputs, *outputs), self.tokens, self.hidden, *scalars)


@functools.lru_cache(maxsize=1024)
def row_forward_plan(step: str, streams: int, active: int, tokens: int, hidden: int, device: int) -> RowForwardPlan:
    return RowForwardPlan(step, streams, active, tokens, hidden, device)


def _backward_blocks(device: int, tokens: int) -> int:
    return max(1, min(tokens, _device.sm_count(device) * BACKWARD_BLOCKS_PER_SM))


def _routed_default(step: str, device: int, streams: int, hidden: int) -> int:
    """The predict or correct backward's default version on `device`: the newest up to DEFAULT's
    whose shared memory lets BACKWARD_BLOCKS_PER_SM blocks share an SM. Slice-major sums take 48 KiB at N = 4,
    so an SM of 100 KiB (sm_86, sm_89) holds one block of such a version where it holds two of v1."""
    available = _device.shared_memory_per_sm(device) // BACKWARD_BLOCKS_PER_SM - ROUTED_BACKWARD_OTHER_SHARED
    fitting = [v for v, entry in enumerate(KERNELS[step][:DEFAULT[step]], 1)
               if entry.weight_sums_bytes(streams, hidden) <= available]
    return max(fitting, default=1)


# The per-block weight-gradient partials of the predict and correct backward.
_PARTIALS = StreamScratch()


class RoutedBackwardPlan:
    """The predict or correct backward at one shape: its kernel writes the activation gradients and
    one partial row per block (the router's S: N * H columns, then the coefficient gradient's
    `coef_columns`), and `altup_router_grads_v1` sums the partials in a fixed order into the weight
    gradients (dR = s w S, dw = s sum_n R_n S_n), finished in bf16.
    inputs: (grad, grad_active or None, the forward's inputs: predict hidden states, P, R, w;
    correct predictions, activated, Q, R, w); outputs: (the activation gradients: predict grad
    hidden states; correct grad predictions, grad activated; then grad of the coefficients, grad R,
    grad w); scalars: (eps, router_scale)."""

    def __init__(self, step: str, version: int, streams: int, active: int, grad_active: bool, tokens: int,
                 hidden: int, device: int):
        coef_columns = streams ** (3 if step == "predict_backward" else 2)
        self.blocks = _backward_blocks(device, tokens)
        self.stride = round_up(streams * hidden + coef_columns, 4)  # 16-byte aligned partial rows
        self.main = _row_launch(step, version, (streams, active, _CPP_BOOL[grad_active]), device, _row_threads(hidden),
                                KERNELS[step][version - 1].weight_sums_bytes(streams, hidden))
        # 32 columns a block, 32 chains of partial rows each: the hidden columns, then the coefficients
        self.sum = _row_launch("router_grads", 1, (streams,), device, 1024)
        self.sum_grid = ceil_div(hidden, 32) + ceil_div(coef_columns, 32)
        self.tokens, self.hidden, self.coef_columns = tokens, hidden, coef_columns

    def __call__(self, inputs, outputs, scalars, stream: int, reuse_scratch: bool = False) -> None:
        eps, router_scale = scalars
        *activation_grads, grad_coefs, grad_R, grad_w = outputs
        router_weight, norm_weight = inputs[-2:]
        partials, key = _PARTIALS.take(4 * self.blocks * self.stride, router_weight.device, stream, reuse_scratch)
        address = partials.data_ptr()
        self.main(stream, self.blocks, *_addresses(*inputs, *activation_grads), address, self.stride, self.tokens,
                  self.hidden, eps, router_scale)
        self.sum(stream, self.sum_grid, address, self.blocks, self.stride, self.hidden, self.coef_columns,
                 *_addresses(router_weight, norm_weight), router_scale, *_addresses(grad_coefs, grad_R, grad_w))
        _PARTIALS.give_back(partials, key)


@functools.lru_cache(maxsize=1024)
def routed_backward_plan(step: str, version: int | None, streams: int, active: int, grad_active: bool, tokens: int,
                         hidden: int, device: int) -> RoutedBackwardPlan:
    """version None: `_routed_default`'s for the device."""
    version = _routed_default(step, device, streams, hidden) if version is None else check_version(step, version)
    return RoutedBackwardPlan(step, version, streams, active, grad_active, tokens, hidden, device)


def _aligned(nbytes: int) -> int:
    return round_up(nbytes, SCRATCH_ALIGNMENT)


def _magnitude_match_backward_launch(streams: int, base_grad_fp32: bool, hidden: int, device: int,
                            version: int | None = None) -> PackedLaunch:
    base_type = "float" if base_grad_fp32 else "unsigned short"
    return _row_launch("magnitude_match_backward", check_version("magnitude_match_backward", version),
                       (streams, base_type), device, _row_threads(hidden))


def _run_expand_epilogue(launch: PackedLaunch, stream: int, streams: int, tokens: int, hidden: int, x0: int,
                         projected: int, out: int, floor: float) -> None:
    """The expansion's magnitude match (`launch`: KERNELS["expand_forward"]) on addresses: x0 bf16
    [M, H], the fp32 projections [M, N-1, H], out bf16 [N, M, H]; one block per token."""
    launch(stream, tokens, x0, projected, out, hidden, (streams - 1) * hidden, tokens, hidden, floor)


# One call's intermediates and cuBLASLt workspace of the expansion and the collapse, one buffer.
_GEMM_SCRATCH = StreamScratch()


class ExpandPlan:
    """The expansion at one shape: y_k = x0 W_k^T by cuBLASLt into column block k of the fp32
    [M, (N-1) H] projections, then the magnitude match. inputs: (embeddings, W_1 .. W_{N-1});
    outputs: (streams [N, B, S, H], projected [B, S, N-1, H] fp32); scalars: (floor,)."""

    def __init__(self, streams: int, tokens: int, hidden: int, device: int):
        with _device.on(device):
            self.project = _cublas.Gemm(rows=tokens, cols=hidden, inner=hidden, ldd=(streams - 1) * hidden)
        self.epilogue = _row_launch("expand_forward", 1, (streams,), device, _row_threads(hidden))
        self.streams, self.tokens, self.hidden = streams, tokens, hidden

    def __call__(self, inputs, outputs, scalars, stream: int, reuse_scratch: bool = False) -> None:
        embeddings, *projections = inputs
        out, projected = outputs
        floor, = scalars
        tokens, hidden = self.tokens, self.hidden
        workspace, key = _GEMM_SCRATCH.take(max(self.project.workspace_bytes, 1), embeddings.device, stream,
                                            reuse_scratch)
        x0, y = embeddings.data_ptr(), projected.data_ptr()
        for k, w in enumerate(projections):
            self.project(x0, w.data_ptr(), y + 4 * k * hidden, workspace.data_ptr(), stream)
        _run_expand_epilogue(self.epilogue, stream, self.streams, tokens, hidden, x0, y, out.data_ptr(), floor)
        _GEMM_SCRATCH.give_back(workspace, key)


@functools.lru_cache(maxsize=256)
def expand_plan(streams: int, tokens: int, hidden: int, device: int) -> ExpandPlan:
    return ExpandPlan(streams, tokens, hidden, device)


class ExpandBackwardPlan:
    """The expansion's backward at one shape: the magnitude match's backward into gp (bf16
    [M, (N-1) H], scratch) and the base rows' gradient (fp32); then grad_x0 += sum_k gp_k W_k
    summed in fp32 by cuBLASLt, and grad W_k = gp_k^T x0 in one batched call, rounded to bf16 once.
    inputs: (grad_streams, embeddings, W_1 .. W_{N-1}, projected); outputs: (grad_x0 fp32
    [B, S, H], grad W bf16 [N-1, H, H]); scalars: (floor,)."""

    def __init__(self, streams: int, tokens: int, hidden: int, device: int):
        wide = (streams - 1) * hidden  # a row of the projections: N-1 column blocks of H
        with _device.on(device):
            self.to_base = _cublas.Gemm(rows=tokens, cols=hidden, inner=hidden, y_transposed=False, ldx=wide,
                                        accumulate=True)
            self.to_weights = _cublas.Gemm(rows=hidden, cols=hidden, inner=tokens, x_transposed=True,
                                           y_transposed=False, ldx=wide, out_dtype=torch.bfloat16, batch=streams - 1,
                                           x_batch_stride=hidden, d_batch_stride=hidden * hidden)
        self.match = _magnitude_match_backward_launch(streams, True, hidden, device)
        self.workspace_offset = _aligned(2 * tokens * wide)
        self.scratch_bytes = self.workspace_offset + max(self.to_base.workspace_bytes, self.to_weights.workspace_bytes)
        self.streams, self.tokens, self.hidden, self.wide = streams, tokens, hidden, wide

    def __call__(self, inputs, outputs, scalars, stream: int, reuse_scratch: bool = False) -> None:
        grad_streams, embeddings, *projections, projected = inputs
        grad_base, grad_weights = outputs
        floor, = scalars
        tokens, hidden = self.tokens, self.hidden
        scratch, key = _GEMM_SCRATCH.take(self.scratch_bytes, embeddings.device, stream, reuse_scratch)
        gp = scratch.data_ptr()
        x0, base, workspace = embeddings.data_ptr(), grad_base.data_ptr(), gp + self.workspace_offset
        self.match(stream, tokens, grad_streams.data_ptr(), x0, projected.data_ptr(), gp, base, tokens * hidden,
                   1.0, hidden, self.wide, hidden, floor)
        for k, w in enumerate(projections):
            self.to_base(gp + 2 * k * hidden, w.data_ptr(), base, workspace, stream)
        self.to_weights(gp, x0, grad_weights.data_ptr(), workspace, stream)
        _GEMM_SCRATCH.give_back(scratch, key)


@functools.lru_cache(maxsize=256)
def expand_backward_plan(streams: int, tokens: int, hidden: int, device: int) -> ExpandBackwardPlan:
    return ExpandBackwardPlan(streams, tokens, hidden, device)


class CollapseBackwardPlan:
    """The collapse's backward at one shape: recompute y_k = s_k U_k^T (fp32, scratch), the
    magnitude match's backward into gp (bf16, scratch) and grad s_0, then grad s_k = gp_k U_k and
    grad U_k = gp_k^T s_k (one batched call, fp32 sums rounded to bf16 once).
    inputs: (grad_output, hidden_states, U_1 .. U_{N-1}); outputs: (grad_hidden_states,
    grad U [N-1, H, H]); scalars: (floor,)."""

    def __init__(self, streams: int, tokens: int, hidden: int, device: int):
        plane = tokens * hidden  # one stream's rows
        with _device.on(device):
            self.project = _cublas.Gemm(rows=tokens, cols=hidden, inner=hidden)
            self.to_streams = _cublas.Gemm(rows=tokens, cols=hidden, inner=hidden, y_transposed=False,
                                           out_dtype=torch.bfloat16)
            self.to_weights = _cublas.Gemm(rows=hidden, cols=hidden, inner=tokens, x_transposed=True,
                                           y_transposed=False, out_dtype=torch.bfloat16, batch=streams - 1,
                                           x_batch_stride=plane, y_batch_stride=plane, d_batch_stride=hidden * hidden)
        self.match = _magnitude_match_backward_launch(streams, False, hidden, device)
        # scratch: y [N-1, M, H] fp32, then gp [N-1, M, H] bf16, then the GEMMs' workspace
        self.gp_offset = _aligned(4 * (streams - 1) * plane)
        self.workspace_offset = self.gp_offset + _aligned(2 * (streams - 1) * plane)
        self.scratch_bytes = self.workspace_offset + max(
            self.project.workspace_bytes, self.to_streams.workspace_bytes, self.to_weights.workspace_bytes)
        self.streams, self.tokens, self.hidden, self.plane = streams, tokens, hidden, plane

    def __call__(self, inputs, outputs, scalars, stream: int, reuse_scratch: bool = False) -> None:
        grad_output, hidden_states, *projections = inputs
        grad_s, grad_weights = outputs
        floor, = scalars
        plane = self.plane
        scratch, key = _GEMM_SCRATCH.take(self.scratch_bytes, hidden_states.device, stream, reuse_scratch)
        y = scratch.data_ptr()
        gp, workspace = y + self.gp_offset, y + self.workspace_offset
        s, ds = hidden_states.data_ptr(), grad_s.data_ptr()
        weights = [u.data_ptr() for u in projections]
        for k, u in enumerate(weights):
            self.project(s + 2 * (k + 1) * plane, u, y + 4 * k * plane, workspace, stream)
        self.match(stream, self.tokens, grad_output.data_ptr(), s, y, gp, ds, 0, 1.0 / self.streams, plane,
                   self.hidden, self.hidden, floor)
        for k, u in enumerate(weights):
            self.to_streams(gp + 2 * k * plane, u, ds + 2 * (k + 1) * plane, workspace, stream)
        self.to_weights(gp, s + 2 * plane, grad_weights.data_ptr(), workspace, stream)
        _GEMM_SCRATCH.give_back(scratch, key)


@functools.lru_cache(maxsize=256)
def collapse_backward_plan(streams: int, tokens: int, hidden: int, device: int) -> CollapseBackwardPlan:
    return CollapseBackwardPlan(streams, tokens, hidden, device)


# ---- the launchers: allocate a step's outputs, run its plan on torch's current stream ----------

def predict_forward(hidden_states, prediction_coefs, router_weight, norm_weight, active_idx: int,
                    eps: float, router_scale: float, with_active: bool = False):
    """The predictions [N, B, S, H]; with_active: (predictions, a copy of predictions[active_idx])."""
    streams, hidden = hidden_states.shape[0], hidden_states.shape[-1]
    device = hidden_states.get_device()
    out = torch.empty_like(hidden_states)
    active = torch.empty_like(hidden_states[0]) if with_active else None
    plan = row_forward_plan("predict_forward", streams, active_idx, hidden_states.numel() // (streams * hidden), hidden,
                            device)
    with _device.on(device):
        plan((hidden_states, prediction_coefs, router_weight, norm_weight), (out, active), (eps, router_scale),
             _stream(device))
    return (out, active) if with_active else out


def correct_forward(predictions, activated, correction_coefs, router_weight, norm_weight, active_idx: int,
                    eps: float, router_scale: float, with_active: bool = False):
    """The corrected streams [N, B, S, H]; with_active: (corrected, a copy of corrected[active_idx])."""
    streams, hidden = predictions.shape[0], predictions.shape[-1]
    device = predictions.get_device()
    out = torch.empty_like(predictions)
    active = torch.empty_like(activated) if with_active else None
    plan = row_forward_plan("correct_forward", streams, active_idx, activated.numel() // hidden, hidden, device)
    with _device.on(device):
        plan((predictions, activated, correction_coefs, router_weight, norm_weight), (out, active),
             (eps, router_scale), _stream(device))
    return (out, active) if with_active else out


def predict_backward(grad_predictions, hidden_states, prediction_coefs, router_weight, norm_weight,
                     active_idx: int, eps: float, router_scale: float, version: int | None = None,
                     grad_active: torch.Tensor | None = None) -> PredictGradients:
    """`version`: of KERNELS["predict_backward"] (None: `_routed_default`); every version gives the same bits.
    grad_active: the gradient of the forward's separate copy of the active prediction, [B, S, H]."""
    streams, hidden = hidden_states.shape[0], hidden_states.shape[-1]
    device = hidden_states.get_device()
    outputs = PredictGradients(torch.empty_like(hidden_states), torch.empty_like(prediction_coefs),
                               torch.empty_like(router_weight), torch.empty_like(norm_weight))
    plan = routed_backward_plan("predict_backward", version, streams, active_idx, grad_active is not None,
                                hidden_states.numel() // (streams * hidden), hidden, device)
    with _device.on(device):
        plan((grad_predictions, grad_active, hidden_states, prediction_coefs, router_weight, norm_weight), outputs,
             (eps, router_scale), _stream(device))
    return outputs


def correct_backward(grad_corrected, predictions, activated, correction_coefs, router_weight, norm_weight,
                     active_idx: int, eps: float, router_scale: float, version: int | None = None,
                     grad_active: torch.Tensor | None = None) -> CorrectGradients:
    """`version`: of KERNELS["correct_backward"] (None: `_routed_default`); every version gives the same bits.
    grad_active: the gradient of the forward's separate copy of the corrected active row, [B, S, H]."""
    streams, hidden = predictions.shape[0], predictions.shape[-1]
    device = predictions.get_device()
    outputs = CorrectGradients(torch.empty_like(predictions), torch.empty_like(activated),
                               torch.empty_like(correction_coefs), torch.empty_like(router_weight),
                               torch.empty_like(norm_weight))
    plan = routed_backward_plan("correct_backward", version, streams, active_idx, grad_active is not None,
                                activated.numel() // hidden, hidden, device)
    with _device.on(device):
        plan((grad_corrected, grad_active, predictions, activated, correction_coefs, router_weight, norm_weight),
             outputs, (eps, router_scale), _stream(device))
    return outputs


def expand_forward(embeddings, projections: Sequence[torch.Tensor], floor: float):
    """(streams [N, B, S, H] bf16, projected [B, S, N-1, H] fp32: x0 @ W_k^T, kept for the backward)."""
    hidden = embeddings.shape[-1]
    streams = len(projections) + 1
    device = embeddings.get_device()
    projected = torch.empty((*embeddings.shape[:-1], streams - 1, hidden), dtype=torch.float32,
                            device=embeddings.device)
    out = torch.empty((streams, *embeddings.shape), dtype=embeddings.dtype, device=embeddings.device)
    plan = expand_plan(streams, embeddings.numel() // hidden, hidden, device)
    with _device.on(device):
        plan((embeddings, *projections), (out, projected), (floor,), _stream(device))
    return out, projected


def expand_epilogue(device: int, streams: int, tokens: int, hidden: int, x0: int, projected: int, out: int,
                    floor: float) -> None:
    """The expansion's magnitude match alone, on addresses: out[0] = x0 and out[k] = projected[:, k-1]
    scaled to x0's root mean square (x0 bf16 [M, H], projected fp32 [M, N-1, H], out bf16 [N, M, H])."""
    with _device.on(device):
        launch = _row_launch("expand_forward", 1, (streams,), device, _row_threads(hidden))
        _run_expand_epilogue(launch, _stream(device), streams, tokens, hidden, x0, projected, out, floor)


def magnitude_match_backward(device: int, streams: int, tokens: int, hidden: int, grad: int, grad_stream_stride: int,
                             grad_scale: float, base: int, projected: int, proj_strides: tuple[int, int],
                             grad_projected: int, grad_base: int, base_grad_fp32: bool, floor: float,
                             version: int | None = None) -> None:
    """The magnitude match's backward alone (kernels/altup_magnitude_match_v1.cu), on addresses: g_k
    at grad + k * grad_stream_stride (bf16 rows, scaled by grad_scale), the base rows and the fp32
    projections, element (k, t, d) of the projections and their gradient (bf16) at
    k * proj_strides[0] + t * proj_strides[1] + d; the base rows' gradient in fp32 or bf16.
    `version`: of KERNELS["magnitude_match_backward"] (None: the default); every version gives the
    same bits."""
    with _device.on(device):
        _magnitude_match_backward_launch(streams, base_grad_fp32, hidden, device, version)(
            _stream(device), tokens, grad, base, projected, grad_projected, grad_base, grad_stream_stride, grad_scale,
            proj_strides[0], proj_strides[1], hidden, floor)


def expand_backward(grad_streams, embeddings, projections: Sequence[torch.Tensor], projected, floor: float):
    """(grad_embeddings bf16 [B, S, H], grad W bf16 [N-1, H, H]): the weight gradients accumulated in
    fp32 and rounded once."""
    streams, hidden = grad_streams.shape[0], embeddings.shape[-1]
    device = embeddings.get_device()
    grad_base = torch.empty(embeddings.shape, dtype=torch.float32, device=embeddings.device)
    grad_weights = torch.empty((streams - 1, hidden, hidden), dtype=embeddings.dtype, device=embeddings.device)
    plan = expand_backward_plan(streams, embeddings.numel() // hidden, hidden, device)
    with _device.on(device):
        plan((grad_streams, embeddings, *projections, projected), (grad_base, grad_weights), (floor,), _stream(device))
    return grad_base.to(embeddings.dtype), grad_weights


def collapse_backward(grad_output, hidden_states, projections: Sequence[torch.Tensor], floor: float):
    """(grad_hidden_states bf16 [N, B, S, H], grad U bf16 [N-1, H, H]); recomputes y_k. The weight
    gradients are accumulated in fp32 and rounded once."""
    streams, hidden = hidden_states.shape[0], hidden_states.shape[-1]
    device = hidden_states.get_device()
    grad_s = torch.empty_like(hidden_states)
    grad_weights = torch.empty((streams - 1, hidden, hidden), dtype=hidden_states.dtype, device=hidden_states.device)
    plan = collapse_backward_plan(streams, grad_output.numel() // hidden, hidden, device)
    with _device.on(device):
        plan((grad_output, hidden_states, *projections), (grad_s, grad_weights), (floor,), _stream(device))
    return grad_s, grad_weights
