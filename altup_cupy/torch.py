"""Differentiable Gemma 3n AltUp steps for PyTorch: `predict`, `correct`, `expand`, `collapse`.

    from altup_cupy.torch import predict, correct, expand, collapse
    (and predict_with_active, correct_with_active: the same steps with the active row as a
    tensor of its own, for layers that read it apart from the N streams)

    pred      = predict(hidden_states, prediction_coefs, router_weight, norm_weight, active_idx, eps)
    activated = layer(pred[active_idx])            # the decoder layer proper, any torch code
    corrected = correct(pred, activated, correction_coefs, router_weight, norm_weight, active_idx, eps)
    streams   = expand(embeddings, [W_1, .., W_{N-1}])      # model input: N streams
    out       = collapse(streams, [U_1, .., U_{N-1}])       # model output: one hidden state

Each is one custom operator of the `altup_cupy` namespace (see `gemma3n_altup`) with its backward
registered through `_operators.Operator.register_autograd` (torch.library.register_autograd's
kernel, and a shortcut for calls that record no gradient), so they compose with torch.compile
(fullgraph) and CUDA graphs, and their CUDA backwards are bitwise deterministic. Their backwards
are kernels with no derivative of their own: a second derivative (autograd.grad(...,
create_graph=True) through one of them) raises a RuntimeError instead of a wrong result. predict and
correct are separate autograd nodes: in the model `activated` is computed from the active
prediction, and autograd runs the layer's backward between them. Gradients come back in each
input's dtype (the kernels accumulate weight gradients in fp32 and round once).
The router is route(x) = tanh(R (x rsqrt(mean(x^2) + eps) w s)) with s = router_scale, 1 / H by
default (transformers' models use their `router_input_scale` buffer: 1 / H rounded to the model's
dtype). No coefficient clipping happens here: a caller that clips (transformers in training mode)
passes clipped weights (see `altup_cupy.gemma3n`).

Inputs are checked as the top-level ops check theirs, under the same names: on CUDA every tensor
is bfloat16; on the CPU (the reference: float32, float64 for float64 inputs) the tensors of a call
share one dtype, bfloat16, float32 or float64; eps, floor and router_scale are finite and > 0; a
failed check raises TypeError or ValueError naming the argument. `collapse` is the
top-level `altup_cupy.collapse` operator with a backward, and takes its arguments.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import _arrays
from .ops import gemma3n_altup
from .ops.collapse import check_stacked, collapse_op
from .reference.gemma3n import MAGNITUDE_FLOOR

_ops = torch.ops.altup_cupy


def _like(grad, t):
    """grad in t's dtype; the same tensor when it already is (no dispatcher call: an eager backward
    runs this for every gradient)."""
    return grad if grad is None or grad.dtype == t.dtype else grad.to(t.dtype)


def _first_order_only(op: str, *tensors) -> None:
    """Refuse to build a graph of a backward (create_graph=True, which enables grad mode in the
    backward) where something would be differentiated through it: the backward operators are
    kernels that autograd would treat as constants, a silently wrong second derivative."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(f"altup_cupy: the backward of {op} is not differentiable: second derivatives "
                           "(torch.autograd.grad(..., create_graph=True) through it) are not supported")


def _router_scale(router_scale, x):
    if router_scale is not None:
        return _arrays.positive_finite("router_scale", router_scale)
    hidden = x.shape[-1]
    return 1.0 / hidden if hidden else 1.0  # H = 0: the operator refuses it by name


def _check_tensors(names: Sequence[str], *tensors) -> None:
    """Each argument a torch tensor (the operators' schemas would refuse anything else in the
    dispatcher's words, without the argument's name)."""
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_matrices(first_name: str, first: torch.Tensor, list_name: str, matrices: list) -> None:
    _check_tensors((first_name, *(f"{list_name}[{i}]" for i in range(len(matrices)))), first, *matrices)


_PREDICT_TENSORS = ("hidden_states", "prediction_coefs", "router_weight", "norm_weight")
_CORRECT_TENSORS = ("predictions", "activated", "correction_coefs", "router_weight", "norm_weight")


def _register_routed_autograd(op: str, step: str) -> None:
    """Registers the autograd of `op`: predict or correct (`step`), or their `_with_active` forms.
    They take their tensors first, then active_idx, eps and router_scale; the backward saves every
    tensor and `<step>_backward` returns one gradient per tensor (the three others get None). The
    `_with_active` forms' second output, a copy of the active row, passes its gradient to the
    backward kernel as `grad_active`."""
    backward_op = getattr(_ops, f"{step}_backward")

    def setup_context(ctx, inputs, output):
        *tensors, active_idx, eps, router_scale = inputs
        ctx.save_for_backward(*tensors)
        ctx.active_idx, ctx.eps, ctx.router_scale = active_idx, eps, router_scale

    def backward(ctx, grad, grad_active=None):
        saved = ctx.saved_tensors
        _first_order_only(op, grad, grad_active, *saved)
        if grad_active is not None:
            grad_active = grad_active.contiguous()
        grads = backward_op(grad.contiguous(), *saved, ctx.active_idx, ctx.eps, ctx.router_scale,
                            grad_active=grad_active)
        return (*(_like(g, t) for g, t in zip(grads, saved)), None, None, None)

    getattr(gemma3n_altup, op).register_autograd(backward, setup_context)


# ---- predict -----------------------------------------------------------------------------------

_register_routed_autograd("predict", "predict")
_register_routed_autograd("predict_with_active", "predict")


def predict(hidden_states: torch.Tensor, prediction_coefs: torch.Tensor, router_weight: torch.Tensor,
            norm_weight: torch.Tensor, active_idx: int = 0, eps: float = 1e-6,
            router_scale: float | None = None) -> torch.Tensor:
    """pred_i = h_i + sum_j C[i][j] h_j with C = reshape(P route(h_a), [N, N]); [N, B, S, H].
    router_scale: the s of route (module docstring); None: 1 / H."""
    _check_tensors(_PREDICT_TENSORS, hidden_states, prediction_coefs, router_weight, norm_weight)
    return _ops.predict(hidden_states, prediction_coefs, router_weight, norm_weight,
                        _arrays.as_index("active_idx", active_idx), _arrays.positive_finite("eps", eps),
                        _router_scale(router_scale, hidden_states))


def predict_with_active(hidden_states: torch.Tensor, prediction_coefs: torch.Tensor, router_weight: torch.Tensor,
                        norm_weight: torch.Tensor, active_idx: int = 0, eps: float = 1e-6,
                        router_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(pred, a copy of pred[active_idx]) for a layer that reads the active prediction on its own:
    its gradient then joins pred's inside the backward kernel, where pred[active_idx] (a view) would
    make autograd add the two in a pass over all N rows."""
    _check_tensors(_PREDICT_TENSORS, hidden_states, prediction_coefs, router_weight, norm_weight)
    return _ops.predict_with_active(hidden_states, prediction_coefs, router_weight, norm_weight,
                                    _arrays.as_index("active_idx", active_idx), _arrays.positive_finite("eps", eps),
                                    _router_scale(router_scale, hidden_states))


# ---- correct -----------------------------------------------------------------------------------

_register_routed_autograd("correct", "correct")
_register_routed_autograd("correct_with_active", "correct")


def correct(predictions: torch.Tensor, activated: torch.Tensor, correction_coefs: torch.Tensor,
            router_weight: torch.Tensor, norm_weight: torch.Tensor, active_idx: int = 0,
            eps: float = 1e-6, router_scale: float | None = None) -> torch.Tensor:
    """corrected_i = pred_i + k_i (activated - pred_a), k = Q route(activated) + 1; [N, B, S, H].
    router_scale: the s of route (module docstring); None: 1 / H."""
    _check_tensors(_CORRECT_TENSORS, predictions, activated, correction_coefs, router_weight, norm_weight)
    return _ops.correct(predictions, activated, correction_coefs, router_weight, norm_weight,
                        _arrays.as_index("active_idx", active_idx), _arrays.positive_finite("eps", eps),
                        _router_scale(router_scale, activated))


def correct_with_active(predictions: torch.Tensor, activated: torch.Tensor, correction_coefs: torch.Tensor,
                        router_weight: torch.Tensor, norm_weight: torch.Tensor, active_idx: int = 0,
                        eps: float = 1e-6, router_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(corrected, a copy of corrected[active_idx]), as `predict_with_active` is to `predict`."""
    _check_tensors(_CORRECT_TENSORS, predictions, activated, correction_coefs, router_weight, norm_weight)
    return _ops.correct_with_active(predictions, activated, correction_coefs, router_weight, norm_weight,
                                    _arrays.as_index("active_idx", active_idx), _arrays.positive_finite("eps", eps),
                                    _router_scale(router_scale, activated))


# ---- expansion ---------------------------------------------------------------------------------

def _expand_setup(ctx, inputs, output):
    embeddings, projections, floor = inputs
    ctx.save_for_backward(embeddings, output[1], *projections)
    ctx.floor = floor
    ctx.mark_non_differentiable(output[1])


def _expand_backward(ctx, grad_streams, _grad_projected):
    embeddings, projected, *projections = ctx.saved_tensors
    _first_order_only("expand", grad_streams, embeddings, *projections)
    grad_x0, grad_w = _ops.expand_backward(grad_streams.contiguous(), embeddings, projections, projected, ctx.floor)
    return _like(grad_x0, embeddings), [_like(g, w) for g, w in zip(grad_w.unbind(), projections)], None


gemma3n_altup.expand.register_autograd(_expand_backward, _expand_setup)


def expand(embeddings: torch.Tensor, projections: Sequence[torch.Tensor],
           floor: float = MAGNITUDE_FLOOR) -> torch.Tensor:
    """[N, B, S, H]: stream 0 = embeddings, stream k = x0 W_k^T rescaled to x0's RMS (mean square
    floored at `floor`, transformers' 1e-5)."""
    projections = list(projections)
    _check_matrices("embeddings", embeddings, "projections", projections)
    return _ops.expand(embeddings, projections, _arrays.positive_finite("floor", floor))[0]


# ---- collapse ----------------------------------------------------------------------------------

def _collapse_setup(ctx, inputs, output):
    hidden_states, projections, eps, *_version = inputs
    ctx.save_for_backward(hidden_states, *projections)
    ctx.floor = eps
    # the N-1 matrices as one stacked [N-1, H, H] tensor (a form the top-level collapse takes)
    ctx.stacked = len(projections) == 1 and projections[0].dim() == 3


def _collapse_backward(ctx, grad):
    hidden_states, *projections = ctx.saved_tensors
    _first_order_only("collapse", grad, hidden_states, *projections)
    matrices = list(projections[0].unbind()) if ctx.stacked else projections
    grad_s, grad_u = _ops.collapse_backward(grad.contiguous(), hidden_states, matrices, ctx.floor)
    grad_projections = ([_like(grad_u, projections[0])] if ctx.stacked
                        else [_like(g, u) for g, u in zip(grad_u.unbind(), projections)])
    return (_like(grad_s, hidden_states), grad_projections,
            # eps, and version where the dispatcher counts it: one None per remaining input
            *([None] * (len(ctx.needs_input_grad) - 2)))


collapse_op.register_autograd(_collapse_backward, _collapse_setup)


def collapse(hidden_states: torch.Tensor, unembed_projs: Sequence[torch.Tensor] | torch.Tensor,
             eps: float = MAGNITUDE_FLOOR) -> torch.Tensor:
    """[B, S, H] = (s_0 + sum_k y_k rms(s_0) / sqrt(max(mean(y_k^2), eps))) / N, y_k = s_k U_k^T:
    `altup_cupy.collapse` (the same arguments: N-1 matrices, or one stacked [N-1, H, H] tensor; eps:
    the floor of the projections' mean square, transformers' 1e-5) with its backward registered."""
    if isinstance(unembed_projs, torch.Tensor):
        check_stacked(unembed_projs)
        unembed_projs = [unembed_projs]
    unembed_projs = list(unembed_projs)
    _check_matrices("hidden_states", hidden_states, "unembed_projs", unembed_projs)
    return _ops.collapse(hidden_states, unembed_projs, _arrays.positive_finite("eps", eps))
