"""The CUDA side of Gemma 3n's AltUp steps: kernel sources and launchers on torch CUDA tensors.

Each launcher takes bf16 CUDA tensors already validated by `gemma3n_ops` (contiguous, 16-byte
aligned rows, H % 8 == 0, 2 <= N <= 4) and runs on torch's current stream of the tensors'
device. The GEMMs of the expansion and collapse run in cuBLASLt (`_cublas`: planned once per shape,
called on addresses, so a call builds no tensor views): bf16 inputs and fp32 accumulation, the
projections written in fp32 (never rounded before the epilogue) and the gradients rounded to bf16
once. Each call's intermediates share one scratch allocation. The predict and correct backward write their
weight gradients per block; `altup_router_grads_v1` sums them in a fixed order and finishes them
in bf16: every result is bitwise deterministic.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from . import _cublas, _device, _sources
from ._build import KernelSource
from ._launch import PackedLaunch, round_up

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


class RowKernel(NamedTuple):
    """One version of one step's kernel: its source, its template, its argument types and the
    template arguments after the call's own (fixed per version). A new version of a step is a new
    entry at the end of the step's tuple in `KERNELS`: a new `.cu` and its `KernelSource` in
    `_sources`, or a new fixed template argument of an existing kernel."""
    source: KernelSource
    template: str
    arg_types: tuple[str, ...]
    fixed: tuple[str, ...] = ()

    def instance(self, params: tuple) -> str:
        """The name expression of the instantiation <params..., fixed...> (as `_sources` lists it)."""
        return f"{self.template}<{', '.join((*map(str, params), *self.fixed))}>"


def _routed_backward_versions(source: KernelSource, template: str, arg_types: tuple[str, ...],
                              versions: tuple[tuple[str, ...], ...]):
    """The predict or correct backward's versions: one per tuple of fixed template arguments (`_sources`)."""
    return tuple(RowKernel(source, template, arg_types, fixed) for fixed in versions)


# Each step's versions, oldest first; the last is the one the operators use (`DEFAULT`), except
# where `_routed_default` picks an older predict or correct backward for the GPU at hand.
KERNELS = {
    # <N, active index>
    "predict_forward": (RowKernel(_sources.ALTUP_PREDICT_V1, "altup_predict_forward_v1", _PTR * 6 + _FORWARD_TAIL),),
    # <N, active index, grad_active given, weight-sum layout, row storage>: v1 row-major sums (8-way bank conflicts),
    # v2 slice-major, v3 slice-major with the token's rows packed in registers (g read once)
    "predict_backward": _routed_backward_versions(_sources.ALTUP_PREDICT_V1, "altup_predict_backward",
                                                  _PTR * 8 + _BACKWARD_TAIL, _sources.PREDICT_BACKWARD_VERSIONS),
    "correct_forward": (RowKernel(_sources.ALTUP_CORRECT_V1, "altup_correct_forward_v1", _PTR * 7 + _FORWARD_TAIL),),
    # <N, active index, grad_active given, weight-sum layout>: v1 row-major, v2 slice-major
    "correct_backward": _routed_backward_versions(_sources.ALTUP_CORRECT_V1, "altup_correct_backward",
                                                  _PTR * 10 + _BACKWARD_TAIL, _sources.CORRECT_BACKWARD_VERSIONS),
    # <N>
    "router_grads": (RowKernel(_sources.ALTUP_ROUTER_GRADS_V1, "altup_router_grads_v1",
                               ("ptr", "i32", "i64", "i32", "i32", "ptr", "ptr", "f32", "ptr", "ptr", "ptr")),),
    "expand_forward": (RowKernel(_sources.ALTUP_MAGNITUDE_MATCH_V1, "altup_expand_forward_v1",
                                 _PTR * 3 + ("i64", "i64", "i64", "i32", "f32")),),
    # <N, the base row's type>: v1 every row unpacked in registers (2 blocks an SM at H = 2048), v2
    # the bf16 rows packed (3 blocks)
    "magnitude_match_backward": tuple(RowKernel(source, template, _PTR * 5 + ("i64", "f32", "i64", "i64", "i32", "f32"))
                                      for source, template in (
                                          (_sources.ALTUP_MAGNITUDE_MATCH_V1, "altup_magnitude_match_backward_v1"),
                                          (_sources.ALTUP_MAGNITUDE_MATCH_BACKWARD_V2,
                                           "altup_magnitude_match_backward_v2"))),
}
DEFAULT = {step: len(versions) for step, versions in KERNELS.items()}  # version numbers count from 1

# The packed launches built so far, one per kernel version, instantiation, device, block size and
# shared-memory size: a launch converts no argument and looks up no kernel after the first.
_PACKED: dict[tuple, PackedLaunch] = {}


def _packed_launch(key: tuple) -> PackedLaunch:
    step, version, params, device, threads, shared_mem = key
    with _device.on(device):
        entry = KERNELS[step][version - 1]
        kernel = entry.source.kernel(entry.instance(params))
        if shared_mem > kernel.max_dynamic_shared_size_bytes:
            kernel.max_dynamic_shared_size_bytes = shared_mem
        launch = _PACKED[key] = PackedLaunch(kernel, threads, shared_mem, entry.arg_types)
    return launch


def _launch(step: str, params: tuple, device: int, grid: int, threads: int, args, shared_mem: int = 0,
            version: int | None = None) -> None:
    """One launch of version `version` (default: DEFAULT[step]) of KERNELS[step]<params> on torch's
    current stream of CUDA device `device` (its raw handle: a capture of that stream captures the
    launch). The arguments are plain Python numbers: the packed launch stores them by the kernel's
    argument types."""
    key = (step, version or DEFAULT[step], params, device, threads, shared_mem)
    launch = _PACKED.get(key) or _packed_launch(key)
    with _device.on(device):  # the kernel lives in `device`'s context
        launch(torch._C._cuda_getCurrentRawStream(device), grid, *args)


def check_version(step: str, version: int | None) -> int:
    """`version`, or the step's default for None; a ValueError names the versions there are."""
    if version is None:
        return DEFAULT[step]
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= len(KERNELS[step]):
        raise ValueError(f"{step}: version must be one of {list(range(1, len(KERNELS[step]) + 1))}, got {version!r}")
    return version


def _backward_blocks(device: int, tokens: int) -> int:
    return max(1, min(tokens, _device.sm_count(device) * BACKWARD_BLOCKS_PER_SM))


def _partials(device: int, blocks: int, columns: int) -> tuple[torch.Tensor, int]:
    """[blocks, stride] fp32 with the stride rounded up to 4 floats (16-byte aligned rows)."""
    stride = (columns + 3) // 4 * 4
    return torch.empty((blocks, stride), dtype=torch.float32, device=device), stride


def _router_grads(partials: torch.Tensor, coef_columns: int, router_weight: torch.Tensor,
                  norm_weight: torch.Tensor, router_scale: float):
    """(grad of the coefficients, flat; grad R; grad w), bf16, from a backward kernel's partials
    (kernels/altup_router_grads_v1.cu: the sums in a fixed order, then dR = s w S and
    dw = s sum_n R_n S_n)."""
    streams, hidden = router_weight.shape
    grad_coefs = torch.empty(coef_columns, dtype=router_weight.dtype, device=router_weight.device)
    grad_R, grad_w = torch.empty_like(router_weight), torch.empty_like(norm_weight)
    # 32 columns a block, 32 chains of partial rows each: the hidden columns, then the coefficients
    grid = (hidden + 31) // 32 + (coef_columns + 31) // 32
    _launch("router_grads", (streams,), partials.get_device(), grid, 1024,
            (partials.data_ptr(), partials.shape[0], partials.shape[1], hidden,
             coef_columns, *_addresses(router_weight, norm_weight), router_scale,
             *_addresses(grad_coefs, grad_R, grad_w)))
    return grad_coefs, grad_R, grad_w


def predict_forward(hidden_states, prediction_coefs, router_weight, norm_weight, active_idx: int,
                    eps: float, router_scale: float, with_active: bool = False):
    """The predictions [N, B, S, H]; with_active: (predictions, a copy of predictions[active_idx])."""
    streams, hidden = hidden_states.shape[0], hidden_states.shape[-1]
    tokens = hidden_states.numel() // (streams * hidden)
    out = torch.empty_like(hidden_states)
    active = torch.empty_like(hidden_states[0]) if with_active else None
    _launch("predict_forward", (streams, active_idx), hidden_states.get_device(), tokens, _row_threads(hidden),
            (*_addresses(hidden_states, prediction_coefs, router_weight, norm_weight, out, active),
             tokens, hidden, eps, router_scale))
    return (out, active) if with_active else out


_ROUTED_DEFAULTS: dict[tuple[str, int, int, int], int] = {}


def _routed_default(step: str, device: int, streams: int, hidden: int) -> int:
    """The predict or correct backward's default version on `device`: the newest whose shared
    memory lets BACKWARD_BLOCKS_PER_SM blocks share an SM. Slice-major sums take 48 KiB at N = 4,
    so an SM of 100 KiB (sm_86, sm_89) holds one block of such a version where it holds two of v1."""
    key = (step, device, streams, hidden)
    if key not in _ROUTED_DEFAULTS:
        available = _device.shared_memory_per_sm(device) // BACKWARD_BLOCKS_PER_SM - ROUTED_BACKWARD_OTHER_SHARED
        fitting = [v for v, entry in enumerate(KERNELS[step], 1)
                   if _dynamic_shared_bytes(entry, streams, hidden) <= available]
        _ROUTED_DEFAULTS[key] = max(fitting, default=1)
    return _ROUTED_DEFAULTS[key]


def _dynamic_shared_bytes(entry: RowKernel, streams: int, hidden: int) -> int:
    """The dynamic shared memory of a predict or correct backward version: its weight-gradient
    sums (its first fixed template argument), N * H floats row-major or 8 N planes of
    ROW_THREADS_MAX floats slice-major (kernels/altup_rows.cuh)."""
    return 4 * streams * (hidden if entry.fixed[0] == "RowMajorSums" else 8 * _sources.ROW_THREADS_MAX)


def _routed_backward(step: str, version: int | None, active_idx: int, tensors: Sequence[torch.Tensor],
                     coef_columns: int, router_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     router_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launches KERNELS[step] (the predict or correct backward) and sums its per-block partials.

    tensors: the kernel's pointer arguments before the partials (None: a null pointer), the first one
    [N, B, S, H], the second grad_active. A block's
    partial row holds S (N * H columns, see `_router_grads`), then `coef_columns` coefficient-gradient
    columns. Returns (the coefficient gradient, flat; grad R; grad w), in the weights' dtype (bf16)."""
    like = tensors[0]
    streams, hidden, device = like.shape[0], like.shape[-1], like.get_device()
    tokens = like.numel() // (streams * hidden)
    blocks, threads = _backward_blocks(device, tokens), _row_threads(hidden)
    version = _routed_default(step, device, streams, hidden) if version is None else check_version(step, version)
    partials, stride = _partials(device, blocks, streams * hidden + coef_columns)
    active = tensors[1] is not None  # grad_active: a template argument, no test or load without it
    _launch(step, (streams, active_idx, _CPP_BOOL[active]), device, blocks, threads,
            (*_addresses(*tensors), partials.data_ptr(), stride, tokens, hidden, eps, router_scale),
            shared_mem=_dynamic_shared_bytes(KERNELS[step][version - 1], streams, hidden), version=version)
    return _router_grads(partials, coef_columns, router_weight, norm_weight, router_scale)


def predict_backward(grad_predictions, hidden_states, prediction_coefs, router_weight, norm_weight,
                     active_idx: int, eps: float, router_scale: float, version: int | None = None,
                     grad_active: torch.Tensor | None = None) -> PredictGradients:
    """`version`: of KERNELS["predict_backward"] (None: `_routed_default`); every version gives the same bits.
    grad_active: the gradient of the forward's separate copy of the active prediction, [B, S, H]."""
    streams = hidden_states.shape[0]
    grad_h = torch.empty_like(hidden_states)
    grad_P, grad_R, grad_w = _routed_backward(
        "predict_backward", version, active_idx,
        (grad_predictions, grad_active, hidden_states, prediction_coefs, router_weight,
         norm_weight, grad_h), streams ** 3, router_weight, norm_weight, eps, router_scale)
    return PredictGradients(grad_h, grad_P.view(streams * streams, streams), grad_R, grad_w)


def correct_forward(predictions, activated, correction_coefs, router_weight, norm_weight, active_idx: int,
                    eps: float, router_scale: float, with_active: bool = False):
    """The corrected streams [N, B, S, H]; with_active: (corrected, a copy of corrected[active_idx])."""
    streams, hidden = predictions.shape[0], predictions.shape[-1]
    tokens = activated.numel() // hidden
    out = torch.empty_like(predictions)
    active = torch.empty_like(activated) if with_active else None
    _launch("correct_forward", (streams, active_idx), predictions.get_device(), tokens, _row_threads(hidden),
            (*_addresses(predictions, activated, correction_coefs, router_weight, norm_weight, out, active),
             tokens, hidden, eps, router_scale))
    return (out, active) if with_active else out


def correct_backward(grad_corrected, predictions, activated, correction_coefs, router_weight, norm_weight,
                     active_idx: int, eps: float, router_scale: float, version: int | None = None,
                     grad_active: torch.Tensor | None = None) -> CorrectGradients:
    """`version`: of KERNELS["correct_backward"] (None: `_routed_default`); every version gives the same bits.
    grad_active: the gradient of the forward's separate copy of the corrected active row, [B, S, H]."""
    streams = predictions.shape[0]
    grad_pred, grad_x = torch.empty_like(predictions), torch.empty_like(activated)
    grad_Q, grad_R, grad_w = _routed_backward(
        "correct_backward", version, active_idx,
        (grad_corrected, grad_active, predictions, activated, correction_coefs, router_weight,
         norm_weight, grad_pred, grad_x), streams ** 2, router_weight, norm_weight, eps, router_scale)
    return CorrectGradients(grad_pred, grad_x, grad_Q.view(streams, streams), grad_R, grad_w)


def _scratch(nbytes: int, device: torch.device) -> torch.Tensor:
    """One call's intermediates and cuBLASLt workspace, one allocation (at least 1 byte, so its
    address is real). Callers hold the tensor until they return: the launches that use its address
    are queued after the allocation, and a tensor dropped before them could hand its memory to an
    allocation made in between."""
    return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)


def _aligned(nbytes: int) -> int:
    return round_up(nbytes, SCRATCH_ALIGNMENT)


def expand_forward(embeddings, projections: Sequence[torch.Tensor], floor: float):
    """(streams [N, B, S, H] bf16, projected [B, S, N-1, H] fp32: x0 @ W_k^T, kept for the backward)."""
    hidden = embeddings.shape[-1]
    streams = len(projections) + 1
    tokens = embeddings.numel() // hidden
    device = embeddings.get_device()
    projected = torch.empty((*embeddings.shape[:-1], streams - 1, hidden), dtype=torch.float32,
                            device=embeddings.device)
    out = torch.empty((streams, *embeddings.shape), dtype=embeddings.dtype, device=embeddings.device)
    with _device.on(device):
        # y_k = x0 W_k^T into its column block of the [M, (N-1) H] rows
        project = _cublas.plan(device, rows=tokens, cols=hidden, inner=hidden, ldd=(streams - 1) * hidden)
        scratch = _scratch(project.workspace_bytes, embeddings.device)
        workspace = scratch.data_ptr()
        stream = torch._C._cuda_getCurrentRawStream(device)
        x0, y = embeddings.data_ptr(), projected.data_ptr()
        for k, w in enumerate(projections):
            project(x0, w.data_ptr(), y + 4 * k * hidden, workspace, stream)
    expand_epilogue(device, streams, tokens, hidden, x0, y, out.data_ptr(), floor)
    return out, projected


def expand_epilogue(device: int, streams: int, tokens: int, hidden: int, x0: int, projected: int, out: int,
                    floor: float) -> None:
    """out[0] = x0 and out[k] = projected[:, k-1] scaled to x0's root mean square (addresses of x0
    bf16 [M, H], projected fp32 [M, N-1, H], out bf16 [N, M, H])."""
    _launch("expand_forward", (streams,), device, tokens, _row_threads(hidden),
            (x0, projected, out, hidden, (streams - 1) * hidden, tokens, hidden, floor))


def magnitude_match_backward(device: int, streams: int, tokens: int, hidden: int, grad: int, grad_stream_stride: int,
                             grad_scale: float, base: int, projected: int, proj_strides: tuple[int, int],
                             grad_projected: int, grad_base: int, base_grad_fp32: bool, floor: float,
                             version: int | None = None) -> None:
    """The magnitude match's backward (kernels/altup_magnitude_match_v1.cu) on addresses: g_k at
    grad + k * grad_stream_stride (bf16 rows, scaled by grad_scale), the base rows and the fp32
    projections, element (k, t, d) of the projections and their gradient (bf16) at
    k * proj_strides[0] + t * proj_strides[1] + d; the base rows' gradient in fp32 or bf16.
    `version`: of KERNELS["magnitude_match_backward"] (None: the default); every version gives the
    same bits."""
    base_type = "float" if base_grad_fp32 else "unsigned short"
    _launch("magnitude_match_backward", (streams, base_type), device, tokens, _row_threads(hidden),
            (grad, base, projected, grad_projected, grad_base, grad_stream_stride, grad_scale,
             proj_strides[0], proj_strides[1], hidden, floor),
            version=check_version("magnitude_match_backward", version))


def expand_backward(grad_streams, embeddings, projections: Sequence[torch.Tensor], projected, floor: float):
    """(grad_embeddings bf16 [B, S, H], grad W bf16 [N-1, H, H]): the weight gradients accumulated in
    fp32 and rounded once."""
    streams, hidden = grad_streams.shape[0], embeddings.shape[-1]
    tokens = embeddings.numel() // hidden
    wide = (streams - 1) * hidden  # a row of the projections: N-1 column blocks of H
    device = embeddings.get_device()
    with _device.on(device):
        # grad_x0 = grad_base + sum_k gp_k W_k, summed in fp32 into grad_base, rounded once
        to_base = _cublas.plan(device, rows=tokens, cols=hidden, inner=hidden, y_transposed=False, ldx=wide,
                               accumulate=True)
        # grad W_k = gp_k^T x0, one batched call: gp_k is the k-th column block, x0 the same for all k
        to_weights = _cublas.plan(device, rows=hidden, cols=hidden, inner=tokens, x_transposed=True,
                                  y_transposed=False, ldx=wide, out_dtype=embeddings.dtype, batch=streams - 1,
                                  x_batch_stride=hidden, d_batch_stride=hidden * hidden)
        grad_base = torch.empty(embeddings.shape, dtype=torch.float32, device=embeddings.device)
        grad_weights = torch.empty((streams - 1, hidden, hidden), dtype=embeddings.dtype, device=embeddings.device)
        workspace_offset = _aligned(2 * tokens * wide)
        scratch = _scratch(workspace_offset + max(to_base.workspace_bytes, to_weights.workspace_bytes),
                           embeddings.device)
        gp = scratch.data_ptr()
        x0, base, workspace = embeddings.data_ptr(), grad_base.data_ptr(), gp + workspace_offset
        magnitude_match_backward(device, streams, tokens, hidden, grad_streams.data_ptr(), tokens * hidden, 1.0, x0,
                                 projected.data_ptr(), (hidden, wide), gp, base, True, floor)
        stream = torch._C._cuda_getCurrentRawStream(device)
        for k, w in enumerate(projections):
            to_base(gp + 2 * k * hidden, w.data_ptr(), base, workspace, stream)
        to_weights(gp, x0, grad_weights.data_ptr(), workspace, stream)
    return grad_base.to(embeddings.dtype), grad_weights


def collapse_backward(grad_output, hidden_states, projections: Sequence[torch.Tensor], floor: float):
    """(grad_hidden_states bf16 [N, B, S, H], grad U bf16 [N-1, H, H]); recomputes y_k. The weight
    gradients are accumulated in fp32 and rounded once."""
    streams, hidden = hidden_states.shape[0], hidden_states.shape[-1]
    tokens = grad_output.numel() // hidden
    plane = tokens * hidden  # one stream's rows
    device = hidden_states.get_device()
    with _device.on(device):
        project = _cublas.plan(device, rows=tokens, cols=hidden, inner=hidden)  # y_k = s_k U_k^T, fp32
        to_streams = _cublas.plan(device, rows=tokens, cols=hidden, inner=hidden, y_transposed=False,
                                  out_dtype=hidden_states.dtype)  # grad s_k = gp_k U_k
        # grad U_k = gp_k^T s_k, one batched call over k
        to_weights = _cublas.plan(device, rows=hidden, cols=hidden, inner=tokens, x_transposed=True,
                                  y_transposed=False, out_dtype=hidden_states.dtype, batch=streams - 1,
                                  x_batch_stride=plane, y_batch_stride=plane, d_batch_stride=hidden * hidden)
        grad_s = torch.empty_like(hidden_states)
        grad_weights = torch.empty((streams - 1, hidden, hidden), dtype=hidden_states.dtype,
                                   device=hidden_states.device)
        # scratch: y [N-1, M, H] fp32, then gp [N-1, M, H] bf16, then the GEMMs' workspace
        gp_offset = _aligned(4 * (streams - 1) * plane)
        workspace_offset = gp_offset + _aligned(2 * (streams - 1) * plane)
        scratch = _scratch(workspace_offset + max(project.workspace_bytes, to_streams.workspace_bytes,
                                                  to_weights.workspace_bytes), hidden_states.device)
        y = scratch.data_ptr()
        gp, workspace = y + gp_offset, y + workspace_offset
        s, ds = hidden_states.data_ptr(), grad_s.data_ptr()
        stream = torch._C._cuda_getCurrentRawStream(device)
        for k, u in enumerate(projections):
            project(s + 2 * (k + 1) * plane, u.data_ptr(), y + 4 * k * plane, workspace, stream)
        magnitude_match_backward(device, streams, tokens, hidden, grad_output.data_ptr(), 0, 1.0 / streams, s, y,
                                 (plane, hidden), gp, ds, False, floor)
        for k, u in enumerate(projections):
            to_streams(gp + 2 * k * plane, u.data_ptr(), ds + 2 * (k + 1) * plane, workspace, stream)
        to_weights(gp, s + 2 * plane, grad_weights.data_ptr(), workspace, stream)
    return grad_s, grad_weights
