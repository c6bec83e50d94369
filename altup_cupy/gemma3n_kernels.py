"""The CUDA side of Gemma 3n's AltUp steps: kernel sources and launchers on torch CUDA tensors.

Each launcher takes bf16 CUDA tensors already validated by `gemma3n_ops` (contiguous, 16-byte
aligned rows, H % 8 == 0, 2 <= N <= 4) and runs on torch's current stream of the tensors'
device. The projection GEMMs of the expansion and collapse run in cuBLAS through torch
(`torch.mm(..., out_dtype=torch.float32)`: bf16 inputs, fp32 accumulation and output, so the
projections are never rounded before the epilogue). The predict and correct backward write their
weight gradients per block; `altup_router_grads_v1` sums them in a fixed order and finishes them
in bf16: every result is bitwise deterministic.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from . import _device, _sources
from ._build import KernelSource
from ._launch import PackedLaunch

STREAMS = _sources.SUPPORTED_STREAMS
MAX_HIDDEN = 8 * _sources.ROW_THREADS_MAX  # one block per token holds a row in H / 8 threads
# Blocks of the backward kernels per SM: two are resident at N = 4 and H <= 2048 (at most 128
# registers a thread), and the weight-gradient partials (one row per block) stay small.
BACKWARD_BLOCKS_PER_SM = 2


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


def _addresses(*tensors: torch.Tensor) -> tuple[int, ...]:
    """The device addresses of `tensors`, the kernels' pointer arguments."""
    return tuple(t.data_ptr() for t in tensors)


def _row_threads(hidden: int) -> int:
    """H / 8 threads rounded up to whole warps, and at least N^3 <= 64: in the predict backward
    thread e accumulates the prediction-coefficient gradient entry e."""
    return max(64, (hidden // 8 + 31) // 32 * 32)


# The argument lists of the kernels, as `_launch.ARG_CODES` types: fixed per kernel, so a call
# builds no key from its arguments.
_PTR = ("ptr",)
_FORWARD_TAIL = ("i64", "i32", "f32", "f32")  # tokens, hidden, eps, router scale
_BACKWARD_TAIL = ("i64", "i64", "i32", "f32", "f32")  # partial stride, tokens, hidden, eps, router scale


class RowKernel(NamedTuple):
    """One step's kernel: its source, its template and its argument types. A new version of a step
    is a new `.cu`, its `KernelSource` in `_sources` and this registry's entry pointing at it."""
    source: KernelSource
    template: str
    arg_types: tuple[str, ...]

    def instance(self, params: tuple) -> str:
        """The name expression of the instantiation <params...> (as `_sources` lists it)."""
        return f"{self.template}<{', '.join(map(str, params))}>"


KERNELS = {
    # <N, active index>
    "predict_forward": RowKernel(_sources.ALTUP_PREDICT_V1, "altup_predict_forward_v1", _PTR * 5 + _FORWARD_TAIL),
    "predict_backward": RowKernel(_sources.ALTUP_PREDICT_V1, "altup_predict_backward_v1", _PTR * 7 + _BACKWARD_TAIL),
    "correct_forward": RowKernel(_sources.ALTUP_CORRECT_V1, "altup_correct_forward_v1", _PTR * 6 + _FORWARD_TAIL),
    "correct_backward": RowKernel(_sources.ALTUP_CORRECT_V1, "altup_correct_backward_v1", _PTR * 9 + _BACKWARD_TAIL),
    # <N>
    "router_grads": RowKernel(_sources.ALTUP_ROUTER_GRADS_V1, "altup_router_grads_v1",
                              ("ptr", "i32", "i64", "i32", "i32", "ptr", "ptr", "f32", "ptr", "ptr", "ptr")),
    "expand_forward": RowKernel(_sources.ALTUP_MAGNITUDE_MATCH_V1, "altup_expand_forward_v1",
                                _PTR * 3 + ("i64", "i64", "i64", "i32", "f32")),
    # <N, the base row's type>
    "magnitude_match_backward": RowKernel(_sources.ALTUP_MAGNITUDE_MATCH_V1, "altup_magnitude_match_backward_v1",
                                          _PTR * 5 + ("i64", "f32", "i64", "i64", "i32", "f32")),
}

# The packed launches built so far, one per kernel, instantiation, device, block size and
# shared-memory size: a launch converts no argument and looks up no kernel after the first.
_PACKED: dict[tuple, PackedLaunch] = {}


def _packed_launch(key: tuple) -> PackedLaunch:
    step, params, device, threads, shared_mem = key
    with _device.on(device):
        entry = KERNELS[step]
        kernel = entry.source.kernel(entry.instance(params))
        if shared_mem > kernel.max_dynamic_shared_size_bytes:
            kernel.max_dynamic_shared_size_bytes = shared_mem
        launch = _PACKED[key] = PackedLaunch(kernel, threads, shared_mem, entry.arg_types)
    return launch


def _launch(step: str, params: tuple, device: int, grid: int, threads: int, args, shared_mem: int = 0) -> None:
    """One launch of KERNELS[step]<params> on torch's current stream of CUDA device `device` (its
    raw handle: a capture of that stream captures the launch). The arguments are plain Python
    numbers: the packed launch stores them by the kernel's argument types."""
    key = (step, params, device, threads, shared_mem)
    launch = _PACKED.get(key) or _packed_launch(key)
    with _device.on(device):  # the kernel lives in `device`'s context
        launch(torch._C._cuda_getCurrentRawStream(device), grid, *args)


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
                    eps: float, router_scale: float) -> torch.Tensor:
    streams, hidden = hidden_states.shape[0], hidden_states.shape[-1]
    tokens = hidden_states.numel() // (streams * hidden)
    out = torch.empty_like(hidden_states)
    _launch("predict_forward", (streams, active_idx), hidden_states.get_device(), tokens, _row_threads(hidden),
            (*_addresses(hidden_states, prediction_coefs, router_weight, norm_weight, out),
             tokens, hidden, eps, router_scale))
    return out


def _routed_backward(step: str, active_idx: int, tensors: Sequence[torch.Tensor], coef_columns: int,
                     router_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float, router_scale: float,
                     shared_mem: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launches KERNELS[step] (the predict or correct backward) and sums its per-block partials.

    tensors: the kernel's pointer arguments before the partials, the first one [N, B, S, H]. A block's
    partial row holds S (N * H columns, see `_router_grads`), then `coef_columns` coefficient-gradient
    columns. Returns (the coefficient gradient, flat; grad R; grad w), in the weights' dtype (bf16)."""
    like = tensors[0]
    streams, hidden, device = like.shape[0], like.shape[-1], like.get_device()
    tokens = like.numel() // (streams * hidden)
    blocks = _backward_blocks(device, tokens)
    partials, stride = _partials(device, blocks, streams * hidden + coef_columns)
    _launch(step, (streams, active_idx), device, blocks, _row_threads(hidden),
            (*_addresses(*tensors), partials.data_ptr(), stride, tokens, hidden,
             eps, router_scale),
            shared_mem=shared_mem)
    return _router_grads(partials, coef_columns, router_weight, norm_weight, router_scale)


def predict_backward(grad_predictions, hidden_states, prediction_coefs, router_weight, norm_weight,
                     active_idx: int, eps: float, router_scale: float) -> PredictGradients:
    streams, hidden = hidden_states.shape[0], hidden_states.shape[-1]
    grad_h = torch.empty_like(hidden_states)
    grad_P, grad_R, grad_w = _routed_backward(
        "predict_backward", active_idx,
        (grad_predictions, hidden_states, prediction_coefs, router_weight, norm_weight, grad_h), streams ** 3,
        router_weight, norm_weight, eps, router_scale, shared_mem=4 * streams * hidden)
    return PredictGradients(grad_h, grad_P.view(streams * streams, streams), grad_R, grad_w)


def correct_forward(predictions, activated, correction_coefs, router_weight, norm_weight, active_idx: int,
                    eps: float, router_scale: float) -> torch.Tensor:
    streams, hidden = predictions.shape[0], predictions.shape[-1]
    tokens = activated.numel() // hidden
    out = torch.empty_like(predictions)
    _launch("correct_forward", (streams, active_idx), predictions.get_device(), tokens, _row_threads(hidden),
            (*_addresses(predictions, activated, correction_coefs, router_weight, norm_weight, out),
             tokens, hidden, eps, router_scale))
    return out


def correct_backward(grad_corrected, predictions, activated, correction_coefs, router_weight, norm_weight,
                     active_idx: int, eps: float, router_scale: float) -> CorrectGradients:
    streams, hidden = predictions.shape[0], predictions.shape[-1]
    grad_pred, grad_x = torch.empty_like(predictions), torch.empty_like(activated)
    grad_Q, grad_R, grad_w = _routed_backward(
        "correct_backward", active_idx,
        (grad_corrected, predictions, activated, correction_coefs, router_weight, norm_weight, grad_pred, grad_x),
        streams ** 2, router_weight, norm_weight, eps, router_scale, shared_mem=4 * streams * hidden)
    return CorrectGradients(grad_pred, grad_x, grad_Q.view(streams, streams), grad_R, grad_w)


def _gemm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in cuBLAS: bf16 inputs, fp32 accumulation and output."""
    return torch.mm(a, b, out_dtype=torch.float32)


def expand_forward(embeddings, projections: Sequence[torch.Tensor], floor: float):
    """(streams [N, B, S, H] bf16, projected [B, S, N-1, H] fp32: x0 @ W_k^T, kept for the backward)."""
    hidden = embeddings.shape[-1]
    streams = len(projections) + 1
    tokens = embeddings.numel() // hidden
    x0 = embeddings.reshape(tokens, hidden)
    projected = _gemm_f32(x0, torch.cat(list(projections)).T)  # [M, (N-1) H]: one GEMM for all k
    out = torch.empty((streams, *embeddings.shape), dtype=embeddings.dtype, device=embeddings.device)
    expand_epilogue(x0, projected, out, floor)
    return out, projected.view(*embeddings.shape[:-1], streams - 1, hidden)


def expand_epilogue(x0, projected, out, floor: float) -> None:
    """out[0] = x0 and out[k] = projected[:, k-1] scaled to x0's root mean square (x0 bf16 [M, H],
    projected fp32 [M, (N-1) H], out bf16 [N, M, H])."""
    tokens, hidden = x0.shape
    streams = out.shape[0]
    _launch("expand_forward", (streams,), x0.get_device(), tokens, _row_threads(hidden),
            (*_addresses(x0, projected, out), hidden, (streams - 1) * hidden,
             tokens, hidden, floor))


def magnitude_match_backward(grad, stream_stride: int, scale: float, base, projected, proj_strides,
                             grad_projected, grad_base, floor: float) -> None:
    streams = projected.numel() // base.numel() + 1
    hidden = base.shape[-1]
    base_type = "float" if grad_base.dtype == torch.float32 else "unsigned short"
    _launch("magnitude_match_backward", (streams, base_type), base.get_device(), base.numel() // hidden,
            _row_threads(hidden), (*_addresses(grad, base, projected, grad_projected, grad_base),
                                   stream_stride, scale, proj_strides[0], proj_strides[1], hidden, floor))


def expand_backward(grad_streams, embeddings, projections: Sequence[torch.Tensor], projected, floor: float):
    """(grad_embeddings bf16 [B, S, H], [grad W_k fp32 [H, H]] * (N-1))."""
    streams, hidden = grad_streams.shape[0], embeddings.shape[-1]
    tokens = embeddings.numel() // hidden
    x0 = embeddings.reshape(tokens, hidden)
    grad_projected = torch.empty((tokens, (streams - 1) * hidden), dtype=embeddings.dtype, device=embeddings.device)
    grad_base = torch.empty((tokens, hidden), dtype=torch.float32, device=embeddings.device)
    magnitude_match_backward(grad_streams, tokens * hidden, 1.0, x0, projected, (hidden, (streams - 1) * hidden),
                             grad_projected, grad_base, floor)
    weights = torch.cat(list(projections))  # [(N-1) H, H]
    grad_x0 = (_gemm_f32(grad_projected, weights) + grad_base).to(embeddings.dtype)
    # one GEMM per matrix: the operator's outputs may not be views of one buffer
    grad_weights = [_gemm_f32(gp.T, x0) for gp in grad_projected.split(hidden, dim=1)]
    return grad_x0.view_as(embeddings), grad_weights


def collapse_backward(grad_output, hidden_states, projections: Sequence[torch.Tensor], floor: float):
    """(grad_hidden_states bf16 [N, B, S, H], [grad U_k fp32 [H, H]] * (N-1)); recomputes y_k."""
    streams, hidden = hidden_states.shape[0], hidden_states.shape[-1]
    tokens = grad_output.numel() // hidden
    s = hidden_states.reshape(streams, tokens, hidden)
    projected = torch.stack([_gemm_f32(s[k], U.T) for k, U in enumerate(projections, start=1)])
    grad_s = torch.empty_like(s)
    grad_projected = torch.empty((streams - 1, tokens, hidden), dtype=s.dtype, device=s.device)
    magnitude_match_backward(grad_output, 0, 1.0 / streams, s[0], projected, (tokens * hidden, hidden),
                             grad_projected, grad_s[0], floor)
    grad_U = []
    for k, U in enumerate(projections, start=1):
        torch.mm(grad_projected[k - 1], U, out=grad_s[k])
        grad_U.append(_gemm_f32(grad_projected[k - 1].T, s[k]))
    return grad_s.view_as(hidden_states), grad_U
