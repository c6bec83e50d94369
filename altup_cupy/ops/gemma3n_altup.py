"""PyTorch operators (namespace altup_cupy, registered by `_operators`) for Gemma 3n's AltUp
steps, forward and backward.

    predict(hidden_states, prediction_coefs, router_weight, norm_weight, active_idx, eps, router_scale) -> pred
    predict_backward(grad, hidden_states, ...) -> (grad_hidden_states, grad_P, grad_R, grad_w)
    correct(predictions, activated, correction_coefs, router_weight, norm_weight, active_idx, eps, router_scale)
    correct_backward(grad, predictions, activated, ...) -> (grad_pred, grad_activated, grad_Q, grad_R, grad_w)
    predict_with_active(...) -> (pred, active)      active: a copy of pred[active_idx], its own tensor
    correct_with_active(...) -> (corrected, active)  active: a copy of corrected[active_idx]
    (predict_backward and correct_backward take that copy's gradient as `grad_active` and add it to
    row active_idx of `grad` as they read it: the model's two uses of a row, summed without a pass
    over all N rows)
    expand(embeddings, projections[], floor) -> (streams, projected)   projected: x0 @ W_k^T, [B, S, N-1, H]
    expand_backward(grad_streams, embeddings, projections[], projected, floor) -> (grad_embeddings, grad_W)
    collapse_backward(grad_output, hidden_states, projections[], floor) -> (grad_hidden_states, grad_U)
    (grad_W, grad_U: the N-1 matrices' gradients stacked, [N-1, H, H])

Each has a fake implementation (shapes only: torch.compile, FakeTensorMode), a CUDA implementation
(the kernels of `gemma3n_altup_versions`: bf16 only, N in 2..4, H % 8 == 0, H <= 3072; weight
gradients accumulated in fp32 and returned in the weights' dtype, bf16) and a CPU implementation
held to the same N and H % 8 (what runs on the CPU runs on CUDA; H <= 3072 is CUDA's alone):
`reference.gemma3n` in float32 (float64 for float64 inputs, so torch.autograd.gradcheck runs on
it), results in the input dtype and weight gradients in float32 (float64). router_scale is the s
of route(x) = tanh(R (x rsqrt(mean(x^2) + eps) w s)): 1 / H, or transformers'
`router_input_scale` buffer in the model's dtype. `altup_cupy.torch` makes them differentiable.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .. import _arrays
from .._operators import operator
from ..reference import gemma3n as ref
from . import gemma3n_altup_versions as cuda

BF16 = torch.bfloat16


# ---- validation: named errors before anything runs -------------------------------------------

def _check_tensor(name: str, t, shape: tuple, dims: str, dtype: torch.dtype | None = None) -> None:
    """A tensor of this shape (None: any extent). dtype: the one every input of the call shares
    (the first input's). On the CPU, the dtypes the top-level ops' CPU reference takes; on CUDA,
    _check_cuda asks for bf16."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {_arrays.dtype_name(dtype)} (that of the first tensor: one "
                        f"dtype per call), got {_arrays.dtype_name(t.dtype)}")
    if t.is_cpu:
        _arrays.call_dtype(name, t)
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    _arrays.check_shape(name, t, shape, dims)


def _check_streams_rows(streams_name: str, streams_t, rows: Sequence[tuple[str, torch.Tensor]] = ()):
    """An [N, B, S, H] tensor of a stream count and width the kernels are built for (on the CPU
    too: what runs on the CPU runs on CUDA), and rows [B, S, H] of the same B, S, H; returns (N, H)."""
    _check_tensor(streams_name, streams_t, (None, None, None, None), "N B S H")
    n, b, s, h = streams_t.shape
    _arrays.check_streams_and_width(streams_name, n, h)
    for name, t in rows:
        _check_tensor(name, t, (b, s, h), "B S H", streams_t.dtype)
    return n, h


def _check_router(streams, hidden, router_weight, norm_weight, dtype):
    _check_tensor("router_weight", router_weight, (streams, hidden), "N H", dtype)
    _check_tensor("norm_weight", norm_weight, (hidden,), "H", dtype)


def _check_active(active_idx, streams):
    if isinstance(active_idx, bool) or not isinstance(active_idx, (int, torch.SymInt)):
        raise TypeError(f"active_idx must be an int, got {type(active_idx).__name__}")
    if not 0 <= active_idx < streams:
        raise ValueError(f"active_idx must satisfy 0 <= active_idx < N = {streams}, got {active_idx}")


def _named_projections(projections) -> list[tuple[str, torch.Tensor]]:
    return [(f"projections[{i}]", w) for i, w in enumerate(projections)]


def _check_projections(projections, streams, hidden, dtype):
    if len(projections) != streams - 1:
        raise ValueError(f"projections must hold N-1 = {streams - 1} matrices for N = {streams} streams, "
                         f"got {len(projections)}")
    for name, w in _named_projections(projections):
        _check_tensor(name, w, (hidden, hidden), "H H", dtype)


def cuda_serves(streams: int, hidden: int) -> str | None:
    """None if the kernels take this shape, else why not (the same words the ops raise)."""
    if streams not in cuda.STREAMS:
        return f"N = {streams} streams (the kernels take N in {cuda.STREAMS})"
    if hidden % 8 or hidden > cuda.MAX_HIDDEN:
        return f"hidden size H = {hidden} (the kernels take H % 8 == 0 and H <= {cuda.MAX_HIDDEN})"
    return None


def _check_cuda(tensors: Sequence[tuple[str, torch.Tensor]], streams: int, hidden: int):
    reason = cuda_serves(streams, hidden)
    if reason is not None:
        raise ValueError(f"the CUDA kernels do not take {reason}")
    for name, t in tensors:
        if t.dtype != BF16:
            raise TypeError(f"{name} must be bfloat16 on CUDA, got {t.dtype}")
        _arrays.check_contiguous(name, t)
    _arrays.check_aligned(tensors)  # one device: the validation before this checked it


def _kernels_take(streams_t: torch.Tensor, active_idx, others: Sequence[torch.Tensor], shapes) -> bool:
    """The common case checked in one pass: `streams_t` a [N, B, S, H] CUDA tensor of a shape the
    kernels serve, 0 <= active_idx < N, and every tensor (`streams_t`, then `others`, of the shapes
    `shapes(N, B, S, H)` gives) bf16, contiguous, 16-byte aligned and on one device. False sends
    the call through the full validation, which names what is wrong (or lets a CPU call through).
    Inside a compiled model the ops run once per layer and step, where this check costs a fraction
    of the full one."""
    shape = streams_t.shape
    if len(shape) != 4 or not streams_t.is_cuda or type(active_idx) is not int:
        return False
    n, b, s, h = shape
    if n not in cuda.STREAMS or h % 8 or h > cuda.MAX_HIDDEN or not 0 <= active_idx < n:
        return False
    wanted = shapes(n, b, s, h)
    if len(others) != len(wanted):
        return False
    device = streams_t.get_device()
    for t, want in zip((streams_t, *others), (shape, *wanted)):
        if (t.dtype != BF16 or t.shape != want or t.get_device() != device or not t.is_contiguous()
                or t.data_ptr() % 16):
            return False
    return True


def _predict_shapes(n, b, s, h):  # prediction_coefs, router_weight, norm_weight
    return (n * n, n), (n, h), (h,)


def _correct_shapes(n, b, s, h):  # activated, correction_coefs, router_weight, norm_weight
    return (b, s, h), (n, n), (n, h), (h,)


def _projection_shapes(n, b, s, h):  # the N-1 matrices
    return ((h, h),) * (n - 1)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The CPU implementations compute in float32, or float64 for float64 inputs."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _weight_grad_dtype(t: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype of every operator's weight gradients: on CUDA the weights' own (bf16), rounded to
    once from fp32 sums; on the CPU the compute dtype."""
    return _compute_dtype(t) if t.device.type == "cpu" else weight.dtype


# ---- predict -----------------------------------------------------------------------------------

_PREDICT_NAMES = ("hidden_states", "prediction_coefs", "router_weight", "norm_weight")


def _validate_predict(hidden_states, prediction_coefs, router_weight, norm_weight, active_idx):
    streams, hidden = _check_streams_rows("hidden_states", hidden_states)
    _check_tensor("prediction_coefs", prediction_coefs, (streams * streams, streams), "N*N N", hidden_states.dtype)
    _check_router(streams, hidden, router_weight, norm_weight, hidden_states.dtype)
    _check_active(active_idx, streams)
    _arrays.check_devices(list(zip(_PREDICT_NAMES, (hidden_states, prediction_coefs, router_weight, norm_weight))))
    return streams, hidden


def _predict_forward(hidden_states, prediction_coefs, router_weight, norm_weight, active_idx, eps, router_scale,
                     with_active: bool):
    args = (hidden_states, prediction_coefs, router_weight, norm_weight)
    if not _kernels_take(hidden_states, active_idx, args[1:], _predict_shapes):
        streams, hidden = _validate_predict(*args, active_idx)
        if not hidden_states.is_cuda:
            pred = ref.predict_forward(*args, active_idx, eps, _compute_dtype(hidden_states), router_scale)
            pred = pred.to(hidden_states.dtype)
            return (pred, pred[active_idx].clone()) if with_active else pred
        _check_cuda(list(zip(_PREDICT_NAMES, args)), streams, hidden)
    if hidden_states.numel() == 0:
        pred = torch.empty_like(hidden_states)
        return (pred, torch.empty_like(hidden_states[0])) if with_active else pred
    return cuda.predict_forward(*args, active_idx, eps, router_scale, with_active=with_active)


@operator("predict(Tensor hidden_states, Tensor prediction_coefs, Tensor router_weight, Tensor norm_weight, "
          "SymInt active_idx, float eps, float router_scale) -> Tensor")
def predict(hidden_states: torch.Tensor, prediction_coefs: torch.Tensor, router_weight: torch.Tensor,
            norm_weight: torch.Tensor, active_idx: int, eps: float, router_scale: float) -> torch.Tensor:
    return _predict_forward(hidden_states, prediction_coefs, router_weight, norm_weight, active_idx, eps,
                            router_scale, with_active=False)


@predict.register_fake
def _(hidden_states, prediction_coefs, router_weight, norm_weight, active_idx, eps, router_scale):
    _validate_predict(hidden_states, prediction_coefs, router_weight, norm_weight, active_idx)
    return torch.empty_like(hidden_states)


@operator("predict_with_active(Tensor hidden_states, Tensor prediction_coefs, Tensor router_weight, "
          "Tensor norm_weight, SymInt active_idx, float eps, float router_scale) -> (Tensor, Tensor)")
def predict_with_active(hidden_states: torch.Tensor, prediction_coefs: torch.Tensor, router_weight: torch.Tensor,
                        norm_weight: torch.Tensor, active_idx: int, eps: float,
                        router_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _predict_forward(hidden_states, prediction_coefs, router_weight, norm_weight, active_idx, eps,
                            router_scale, with_active=True)


@predict_with_active.register_fake
def _(hidden_states, prediction_coefs, router_weight, norm_weight, active_idx, eps, router_scale):
    _validate_predict(hidden_states, prediction_coefs, router_weight, norm_weight, active_idx)
    return torch.empty_like(hidden_states), torch.empty_like(hidden_states[0])


def _check_grads(grad_name: str, grad, grad_active, streams_name: str, streams_t) -> None:
    """The incoming gradient of an [N, B, S, H] output, `grad` (of `streams_t`'s shape), and of its
    active row, grad_active (None, or [B, S, H] of grad's dtype), on `streams_t`'s device."""
    _check_tensor(grad_name, grad, tuple(streams_t.shape), "N B S H")
    named = [(streams_name, streams_t), (grad_name, grad)]
    if grad_active is not None:
        _check_tensor("grad_active", grad_active, tuple(grad.shape[1:]), "B S H", grad.dtype)
        named.append(("grad_active", grad_active))
    _arrays.check_devices(named)


def _with_grad_active(grad: torch.Tensor, grad_active, active_idx: int) -> torch.Tensor:
    """grad with grad_active added to row active_idx, in grad's dtype (as autograd would add the
    gradients of two uses of the row): the CPU path's form of what the kernels do as they load."""
    if grad_active is None:
        return grad
    grad = grad.clone()
    grad[active_idx] += grad_active
    return grad


def _validate_predict_backward(grad_predictions, hidden_states, prediction_coefs, router_weight, norm_weight,
                               active_idx, grad_active):
    streams, hidden = _validate_predict(hidden_states, prediction_coefs, router_weight, norm_weight, active_idx)
    _check_grads("grad_predictions", grad_predictions, grad_active, "hidden_states", hidden_states)
    return streams, hidden


@operator("predict_backward(Tensor grad_predictions, Tensor hidden_states, Tensor prediction_coefs, "
          "Tensor router_weight, Tensor norm_weight, SymInt active_idx, float eps, "
          "float router_scale, Tensor? grad_active=None) -> (Tensor, Tensor, Tensor, Tensor)")
def predict_backward(grad_predictions: torch.Tensor, hidden_states: torch.Tensor, prediction_coefs: torch.Tensor,
                     router_weight: torch.Tensor, norm_weight: torch.Tensor, active_idx: int, eps: float,
                     router_scale: float, grad_active: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    args = (grad_predictions, hidden_states, prediction_coefs, router_weight, norm_weight)
    extra = () if grad_active is None else (grad_active,)
    if not _kernels_take(hidden_states, active_idx, (prediction_coefs, router_weight, norm_weight, grad_predictions,
                                                     *extra),
                         lambda n, b, s, h: (*_predict_shapes(n, b, s, h), (n, b, s, h), *((b, s, h),) * len(extra))):
        streams, hidden = _validate_predict_backward(*args, active_idx, grad_active)
        if not hidden_states.is_cuda:
            grad = _with_grad_active(grad_predictions, grad_active, active_idx)
            grads = ref.predict_backward(grad, *args[1:], active_idx, eps, _compute_dtype(hidden_states), router_scale)
            return (grads[0].to(hidden_states.dtype), *grads[1:])
        _check_cuda(list(zip(("grad_predictions", "hidden_states", "prediction_coefs", "router_weight",
                              "norm_weight", "grad_active"), (*args, *extra))), streams, hidden)
    if hidden_states.numel() == 0:
        return _zero_grads(hidden_states, prediction_coefs, router_weight, norm_weight)
    return tuple(cuda.predict_backward(*args, active_idx, eps, router_scale, grad_active=grad_active))


def _zero_grads(activations, *weights):
    """The gradients of an empty batch: zero rows, zero weight gradients."""
    return (torch.zeros_like(activations),
            *(torch.zeros(w.shape, dtype=_weight_grad_dtype(activations, w), device=w.device) for w in weights))


def _stacked_like(activations, projections, make=torch.empty):
    """The projections' gradients, stacked [N-1, H, H], as `make` gives them (in the weights' dtype,
    which on CUDA is the activations')."""
    hidden = activations.shape[-1]
    return make((len(projections), hidden, hidden), dtype=_weight_grad_dtype(activations, activations),
                device=activations.device)


def _zero_projection_grads(activations, projections):
    """The gradients of an empty batch in the layout of expand_backward and collapse_backward."""
    return torch.zeros_like(activations), _stacked_like(activations, projections, torch.zeros)


@predict_backward.register_fake
def _(grad_predictions, hidden_states, prediction_coefs, router_weight, norm_weight, active_idx, eps, router_scale,
      grad_active=None):
    _validate_predict_backward(grad_predictions, hidden_states, prediction_coefs, router_weight, norm_weight,
                               active_idx, grad_active)
    return (torch.empty_like(hidden_states),
            *(w.new_empty(w.shape, dtype=_weight_grad_dtype(hidden_states, w))
              for w in (prediction_coefs, router_weight, norm_weight)))


# ---- correct -----------------------------------------------------------------------------------

_CORRECT_NAMES = ("predictions", "activated", "correction_coefs", "router_weight", "norm_weight")


def _validate_correct(predictions, activated, correction_coefs, router_weight, norm_weight, active_idx):
    streams, hidden = _check_streams_rows("predictions", predictions, [("activated", activated)])
    _check_tensor("correction_coefs", correction_coefs, (streams, streams), "N N", predictions.dtype)
    _check_router(streams, hidden, router_weight, norm_weight, predictions.dtype)
    _check_active(active_idx, streams)
    _arrays.check_devices(list(zip(_CORRECT_NAMES, (predictions, activated, correction_coefs, router_weight,
                                                    norm_weight))))
    return streams, hidden


def _correct_forward(predictions, activated, correction_coefs, router_weight, norm_weight, active_idx, eps,
                     router_scale, with_active: bool):
    args = (predictions, activated, correction_coefs, router_weight, norm_weight)
    if not _kernels_take(predictions, active_idx, args[1:], _correct_shapes):
        streams, hidden = _validate_correct(*args, active_idx)
        if not predictions.is_cuda:
            corrected = ref.correct_forward(*args, active_idx, eps, _compute_dtype(predictions),
                                            router_scale).to(predictions.dtype)
            return (corrected, corrected[active_idx].clone()) if with_active else corrected
        _check_cuda(list(zip(_CORRECT_NAMES, args)), streams, hidden)
    if activated.numel() == 0:
        corrected = torch.empty_like(predictions)
        return (corrected, torch.empty_like(activated)) if with_active else corrected
    return cuda.correct_forward(*args, active_idx, eps, router_scale, with_active=with_active)


@operator("correct(Tensor predictions, Tensor activated, Tensor correction_coefs, Tensor router_weight, "
          "Tensor norm_weight, SymInt active_idx, float eps, float router_scale) -> Tensor")
def correct(predictions: torch.Tensor, activated: torch.Tensor, correction_coefs: torch.Tensor,
            router_weight: torch.Tensor, norm_weight: torch.Tensor, active_idx: int, eps: float,
            router_scale: float) -> torch.Tensor:
    return _correct_forward(predictions, activated, correction_coefs, router_weight, norm_weight, active_idx, eps,
                            router_scale, with_active=False)


@correct.register_fake
def _(predictions, activated, correction_coefs, router_weight, norm_weight, active_idx, eps, router_scale):
    _validate_correct(predictions, activated, correction_coefs, router_weight, norm_weight, active_idx)
    return torch.empty_like(predictions)


@operator("correct_with_active(Tensor predictions, Tensor activated, Tensor correction_coefs, "
          "Tensor router_weight, Tensor norm_weight, SymInt active_idx, float eps, float router_scale) "
          "-> (Tensor, Tensor)")
def correct_with_active(predictions: torch.Tensor, activated: torch.Tensor, correction_coefs: torch.Tensor,
                        router_weight: torch.Tensor, norm_weight: torch.Tensor, active_idx: int, eps: float,
                        router_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _correct_forward(predictions, activated, correction_coefs, router_weight, norm_weight, active_idx, eps,
                            router_scale, with_active=True)


@correct_with_active.register_fake
def _(predictions, activated, correction_coefs, router_weight, norm_weight, active_idx, eps, router_scale):
    _validate_correct(predictions, activated, correction_coefs, router_weight, norm_weight, active_idx)
    return torch.empty_like(predictions), torch.empty_like(activated)


@operator("correct_backward(Tensor grad_corrected, Tensor predictions, Tensor activated, Tensor correction_coefs, "
          "Tensor router_weight, Tensor norm_weight, SymInt active_idx, float eps, "
          "float router_scale, Tensor? grad_active=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
def correct_backward(grad_corrected: torch.Tensor, predictions: torch.Tensor, activated: torch.Tensor,
                     correction_coefs: torch.Tensor, router_weight: torch.Tensor, norm_weight: torch.Tensor,
                     active_idx: int, eps: float, router_scale: float, grad_active: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    args = (predictions, activated, correction_coefs, router_weight, norm_weight)
    extra = () if grad_active is None else (grad_active,)
    if not _kernels_take(predictions, active_idx, (*args[1:], grad_corrected, *extra),
                         lambda n, b, s, h: (*_correct_shapes(n, b, s, h), (n, b, s, h), *((b, s, h),) * len(extra))):
        streams, hidden = _validate_correct(*args, active_idx)
        _check_grads("grad_corrected", grad_corrected, grad_active, "predictions", predictions)
        if not predictions.is_cuda:
            grad = _with_grad_active(grad_corrected, grad_active, active_idx)
            grads = ref.correct_backward(grad, *args, active_idx, eps, _compute_dtype(predictions), router_scale)
            return (grads[0].to(predictions.dtype), grads[1].to(activated.dtype), *grads[2:])
        _check_cuda([("grad_corrected", grad_corrected), *zip(_CORRECT_NAMES, args),
                     *(("grad_active", t) for t in extra)], streams, hidden)
    if activated.numel() == 0:
        return (torch.zeros_like(predictions), *_zero_grads(activated, correction_coefs, router_weight, norm_weight))
    return tuple(cuda.correct_backward(grad_corrected, *args, active_idx, eps, router_scale, grad_active=grad_active))


@correct_backward.register_fake
def _(grad_corrected, predictions, activated, correction_coefs, router_weight, norm_weight, active_idx, eps,
      router_scale, grad_active=None):
    _validate_correct(predictions, activated, correction_coefs, router_weight, norm_weight, active_idx)
    _check_grads("grad_corrected", grad_corrected, grad_active, "predictions", predictions)
    return (torch.empty_like(predictions), torch.empty_like(activated),
            *(w.new_empty(w.shape, dtype=_weight_grad_dtype(predictions, w))
              for w in (correction_coefs, router_weight, norm_weight)))


# ---- expansion ---------------------------------------------------------------------------------

def _validate_expand(embeddings, projections):
    _check_tensor("embeddings", embeddings, (None, None, None), "B S H")
    streams, hidden = len(projections) + 1, embeddings.shape[-1]
    if streams not in cuda.STREAMS:
        raise ValueError(f"projections must hold N-1 matrices for N in {cuda.STREAMS} streams, got "
                         f"{len(projections)}")
    _arrays.check_streams_and_width("embeddings", streams, hidden, "dim 2")
    _check_projections(projections, streams, hidden, embeddings.dtype)
    _arrays.check_devices([("embeddings", embeddings), *_named_projections(projections)])
    return streams, hidden


def _check_floor(floor):
    _arrays.positive_finite("floor", floor)


@operator("expand(Tensor embeddings, Tensor[] projections, float floor) -> (Tensor, Tensor)")
def expand(embeddings: torch.Tensor, projections: list[torch.Tensor], floor: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    streams, hidden = _validate_expand(embeddings, projections)
    _check_floor(floor)
    if embeddings.is_cuda:
        _check_cuda([("embeddings", embeddings), *_named_projections(projections)], streams, hidden)
        if embeddings.numel() == 0:
            return (embeddings.new_empty((streams, *embeddings.shape)),
                    embeddings.new_empty((*embeddings.shape[:-1], streams - 1, hidden), dtype=torch.float32))
        return cuda.expand_forward(embeddings, projections, floor)
    dtype = _compute_dtype(embeddings)
    x0 = embeddings.to(dtype)
    projected = torch.stack([x0 @ w.to(dtype).T for w in projections], dim=-2)  # [B, S, N-1, H]
    matched = ref.magnitude_match_forward(x0, projected.movedim(-2, 0), floor)
    return torch.cat([x0.unsqueeze(0), matched]).to(embeddings.dtype), projected


@expand.register_fake
def _(embeddings, projections, floor):
    streams, hidden = _validate_expand(embeddings, projections)
    return (embeddings.new_empty((streams, *embeddings.shape)),
            embeddings.new_empty((*embeddings.shape[:-1], streams - 1, hidden),
                                 dtype=torch.float32 if embeddings.is_cuda else _compute_dtype(embeddings)))


def _validate_expand_backward(grad_streams, embeddings, projections, projected):
    streams, hidden = _validate_expand(embeddings, projections)
    _check_tensor("grad_streams", grad_streams, (streams, *embeddings.shape), "N B S H")
    _check_tensor("projected", projected, (*embeddings.shape[:-1], streams - 1, hidden), "B S N-1 H")
    _arrays.check_devices([("embeddings", embeddings), ("grad_streams", grad_streams), ("projected", projected)])
    return streams, hidden


@operator("expand_backward(Tensor grad_streams, Tensor embeddings, Tensor[] projections, Tensor projected, "
          "float floor) -> (Tensor, Tensor)")
def expand_backward(grad_streams: torch.Tensor, embeddings: torch.Tensor, projections: list[torch.Tensor],
                    projected: torch.Tensor, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check_floor(floor)
    if not (_kernels_take(grad_streams, 0, (embeddings, *projections),
                          lambda n, b, s, h: ((b, s, h), *_projection_shapes(n, b, s, h)))
            and _projected_ready(projected, embeddings)):
        streams, hidden = _validate_expand_backward(grad_streams, embeddings, projections, projected)
        if not embeddings.is_cuda:
            return _expand_backward_cpu(grad_streams, embeddings, projections, projected, floor)
        _check_cuda([("grad_streams", grad_streams), ("embeddings", embeddings), *_named_projections(projections)],
                    streams, hidden)
        if not _projected_ready(projected, embeddings):
            raise TypeError("projected must be the expansion's own float32 output (contiguous, on the device of "
                            f"embeddings), got {projected.dtype} on {projected.device}")
    if embeddings.numel() == 0:
        return _zero_projection_grads(embeddings, projections)
    return cuda.expand_backward(grad_streams, embeddings, projections, projected, floor)


def _projected_ready(projected, embeddings) -> bool:
    """The saved projections as the CUDA backward reads them (their shape is checked with the rest)."""
    return (projected.dtype == torch.float32 and projected.get_device() == embeddings.get_device()
            and projected.is_contiguous() and projected.data_ptr() % 16 == 0
            and projected.shape[:-2] == embeddings.shape[:-1] and projected.shape[-1] == embeddings.shape[-1])


def _expand_backward_cpu(grad_streams, embeddings, projections, projected, floor):
    hidden = embeddings.shape[-1]
    dtype = _compute_dtype(embeddings)
    g, x0 = grad_streams.to(dtype), embeddings.to(dtype)
    matched = ref.magnitude_match_backward(g[1:], x0, projected.to(dtype).movedim(-2, 0), floor)
    grad_x0 = g[0] + matched.grad_base + sum(gp @ w.to(dtype) for gp, w in zip(matched.grad_projected, projections))
    grad_w = torch.stack([gp.reshape(-1, hidden).T @ x0.reshape(-1, hidden) for gp in matched.grad_projected])
    return grad_x0.to(embeddings.dtype), grad_w


@expand_backward.register_fake
def _(grad_streams, embeddings, projections, projected, floor):
    _validate_expand_backward(grad_streams, embeddings, projections, projected)
    return torch.empty_like(embeddings), _stacked_like(embeddings, projections)


# ---- collapse ----------------------------------------------------------------------------------

def _validate_collapse(hidden_states, projections):
    streams, hidden = _check_streams_rows("hidden_states", hidden_states)
    _check_projections(projections, streams, hidden, hidden_states.dtype)
    _arrays.check_devices([("hidden_states", hidden_states), *_named_projections(projections)])
    return streams, hidden


def _validate_collapse_backward(grad_output, hidden_states, projections):
    streams, hidden = _validate_collapse(hidden_states, projections)
    _check_tensor("grad_output", grad_output, tuple(hidden_states.shape[1:]), "B S H")
    _arrays.check_devices([("hidden_states", hidden_states), ("grad_output", grad_output)])
    return streams, hidden


@operator("collapse_backward(Tensor grad_output, Tensor hidden_states, Tensor[] projections, "
          "float floor) -> (Tensor, Tensor)")
def collapse_backward(grad_output: torch.Tensor, hidden_states: torch.Tensor, projections: list[torch.Tensor],
                      floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check_floor(floor)
    if not _kernels_take(hidden_states, 0, (grad_output, *projections),
                         lambda n, b, s, h: ((b, s, h), *_projection_shapes(n, b, s, h))):
        streams, hidden = _validate_collapse_backward(grad_output, hidden_states, projections)
        if not hidden_states.is_cuda:
            grads = ref.collapse_backward(grad_output, hidden_states, projections, floor,
                                          _compute_dtype(hidden_states))
            return grads.grad_input.to(hidden_states.dtype), torch.stack(list(grads.grad_projections))
        _check_cuda([("grad_output", grad_output), ("hidden_states", hidden_states),
                     *_named_projections(projections)], streams, hidden)
    if grad_output.numel() == 0:
        return _zero_projection_grads(hidden_states, projections)
    return cuda.collapse_backward(grad_output, hidden_states, projections, floor)


@collapse_backward.register_fake
def _(grad_output, hidden_states, projections, floor):
    _validate_collapse_backward(grad_output, hidden_states, projections)
    return torch.empty_like(hidden_states), _stacked_like(hidden_states, projections)

