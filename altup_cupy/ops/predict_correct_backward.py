"""The backward of AltUp's predict + correct step (docs/SPEC.md section 2): six gradients.

`predict_correct_backward(...)` is the public function; `torch.ops.altup_cupy.predict_correct_backward`
the torch operator behind it, registered through `_operators` (fake implementation for torch.compile, the kernels on CUDA,
the reference on the CPU). Eager calls on CUDA tensors that need no autograd take the fast
path: validated inputs go straight to the cached launch plan of their shape.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from .. import _arrays, _device
from .._operators import operator
from ..reference import predict_correct_backward_reference
from . import _registry
from ._registry import fast_path_applies
from .predict_correct_backward_versions import MAX_HIDDEN, PREFERENCE, VERSIONS

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
INPUT_NAMES = ("grad_corrected", "hidden_states", "activated", "prediction_coefs", "correction_coefs",
               "router_weight", "norm_weight")


class PredictCorrectGrads(NamedTuple):
    grad_hidden_states: Any  # bf16 [N, B, S, H]
    grad_activated: Any  # bf16 [B, S, H]
    grad_prediction_coefs: Any  # fp32 [N*N, N]
    grad_correction_coefs: Any  # fp32 [N, N]
    grad_router_weight: Any  # fp32 [N, H]
    grad_norm_weight: Any  # fp32 [H]


def validate(g, hs, act, P, Q, R, w, active_idx, eps):
    """Named errors for anything the kernels cannot take; returns (N, B, S, H, a, eps, device).
    The kernels take bf16; the CPU reference also float32 and float64, every tensor of a call in
    one dtype (as the collapse). The common case (everything right) costs a few attribute reads
    per tensor; the checks in their fixed order, with the messages, run only when one of them
    fails."""
    dtype = _arrays.call_dtype("grad_corrected", g)
    _arrays.check_tensor("grad_corrected", g, dtype, (None, None, None, None), "N B S H")
    streams, batch, seq, hidden = g.shape
    _arrays.check_streams_and_width("grad_corrected", streams, hidden)
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size H (grad_corrected dim 3) must be at most {MAX_HIDDEN}, got {hidden}")
    n, device = streams, g.device
    others = (hs, act, P, Q, R, w)
    shapes = ((n, batch, seq, hidden), (batch, seq, hidden), (n * n, n), (n, n), (n, hidden), (hidden,))
    for t, shape in zip(others, shapes):
        if t.dtype != dtype or t.shape != shape or not t.is_contiguous() or t.device != device:
            _explain(g, others, shapes)
    a = _arrays.index_in_range("active_idx", active_idx, streams)
    eps = _arrays.positive_finite("eps", eps)
    return streams, batch, seq, hidden, a, eps, device


def _explain(g, others, shapes):
    """Raise the named error of the first check that fails, in the fixed order."""
    dims = ("N B S H", "B S H", "N*N N", "N N", "N H", "H")
    for name, t, shape, names in zip(INPUT_NAMES[1:], others, shapes, dims):
        _arrays.check_tensor(name, t, g.dtype, shape, names)
    _arrays.check_devices(list(zip(INPUT_NAMES, (g, *others))))
    raise AssertionError("validate's fast check and its named checks disagree")  # a bug here


def _empty_grads(g, act, separate_weight_grads):
    """The six outputs, shaped and placed after grad_corrected and activated.
    separate_weight_grads False: the four fp32 weight gradients are views of one allocation (one
    call to the caching allocator instead of four; they stay as small as they are). The custom
    operator keeps them separate, as its schema promises unaliased outputs."""
    grad_hs, grad_act = torch.empty_like(g), torch.empty_like(act)
    n, hidden, device = g.shape[0], g.shape[3], g.device
    layouts = (((n * n, n), (n, 1)), ((n, n), (n, 1)), ((n, hidden), (hidden, 1)), ((hidden,), (1,)))
    if separate_weight_grads:
        return (grad_hs, grad_act, *(torch.empty(shape, dtype=F32, device=device) for shape, _ in layouts))
    flat = torch.empty(n ** 3 + n * n + n * hidden + hidden, dtype=F32, device=device)
    views, offset = [], 0
    for shape, strides in layouts:
        views.append(flat.as_strided(shape, strides, offset))
        offset += math.prod(shape)
    return (grad_hs, grad_act, *views)


# The version that serves a call, picked once per shape (its plans are cached by the version).
_version = _registry.picker(VERSIONS, PREFERENCE)


def _run_cuda(inputs, active_idx, eps, version, fast_path=False, make_plan=None):
    """fast_path: called by the public function, outside torch's dispatcher: the weight gradients
    share one allocation and the scratch memory is reused (see _empty_grads, _scratch).
    make_plan: builds the plan instead of the version's own (see run_plan)."""
    streams, batch, seq, hidden, a, eps, device = validate(*inputs, active_idx, eps)
    g, hs, act, _, _, R, w = inputs
    # The rows are read 16 bytes at a time (and by the bulk-copy engine): a view into a larger
    # tensor can start anywhere. The small coefficient matrices are read by scalar loads.
    if (g.data_ptr() | hs.data_ptr() | act.data_ptr() | R.data_ptr() | w.data_ptr()) % _arrays.VECTOR_ALIGNMENT:
        _arrays.check_aligned([(INPUT_NAMES[i], inputs[i]) for i in (0, 1, 2, 5, 6)])
    outs = _empty_grads(inputs[0], inputs[2], separate_weight_grads=not fast_path)
    tokens = batch * seq
    if tokens == 0:
        for weight_grad in outs[2:]:
            weight_grad.zero_()
        return outs
    index = device.index
    if make_plan is None:
        make_plan = _version(version, streams, hidden, index).plan
    plan = make_plan(streams, a, tokens, hidden, index)
    plan(inputs, outs, (eps,), torch._C._cuda_getCurrentRawStream(index), fast_path)
    return outs


def _weight_grad_dtype(g: torch.Tensor) -> torch.dtype:
    """fp32, as the kernels write them; float64 for the CPU reference's float64 inputs. The CPU
    reference computes in this dtype too."""
    return F64 if g.dtype == F64 else F32


@operator("predict_correct_backward(Tensor grad_corrected, Tensor hidden_states, Tensor activated, "
          "Tensor prediction_coefs, Tensor correction_coefs, Tensor router_weight, Tensor norm_weight, "
          "SymInt active_idx, float eps, SymInt? version=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
def predict_correct_backward_op(
        grad_corrected: torch.Tensor, hidden_states: torch.Tensor, activated: torch.Tensor,
        prediction_coefs: torch.Tensor, correction_coefs: torch.Tensor, router_weight: torch.Tensor,
        norm_weight: torch.Tensor, active_idx: int, eps: float, version: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels on CUDA tensors; the reference on CPU tensors."""
    inputs = (grad_corrected, hidden_states, activated, prediction_coefs, correction_coefs,
              router_weight, norm_weight)
    if grad_corrected.is_cuda:
        with _device.on(grad_corrected.device):
            return _run_cuda(inputs, active_idx, eps, version)
    validate(*inputs, active_idx, eps)
    _registry.check_number(VERSIONS, version)
    compute = _weight_grad_dtype(grad_corrected)
    grads = predict_correct_backward_reference(*inputs, active_idx, eps, compute)
    return (grads[0].to(grad_corrected.dtype), grads[1].to(grad_corrected.dtype),
            *(d.contiguous() for d in grads[2:]))


@predict_correct_backward_op.register_fake
def _predict_correct_backward_fake(*args):
    inputs, active_idx, eps = args[:7], args[7], args[8]
    streams, batch, seq, hidden, _, _, _ = validate(*inputs, active_idx, eps)
    _registry.check_number(VERSIONS, args[9] if len(args) > 9 else None)
    g = inputs[0]
    f = _weight_grad_dtype(g)
    return (g.new_empty((streams, batch, seq, hidden)), g.new_empty((batch, seq, hidden)),
            g.new_empty((streams * streams, streams), dtype=f), g.new_empty((streams, streams), dtype=f),
            g.new_empty((streams, hidden), dtype=f), g.new_empty((hidden,), dtype=f))


def predict_correct_backward(grad_corrected: Any, hidden_states: Any, activated: Any,
                             prediction_coefs: Any, correction_coefs: Any, router_weight: Any,
                             norm_weight: Any, active_idx: int = 0, eps: float = 1e-6, *,
                             version: int | None = None) -> PredictCorrectGrads:
    """The six gradients of AltUp's predict + correct step (docs/SPEC.md section 2).

    grad_corrected, hidden_states: bf16 [N, B, S, H]; activated: bf16 [B, S, H];
    prediction_coefs bf16 [N*N, N]; correction_coefs bf16 [N, N]; router_weight bf16 [N, H];
    norm_weight bf16 [H]; N in {2, 3, 4}, H divisible by 8 and at most 8192.
    Returns `PredictCorrectGrads` of the caller's type (torch tensors, or CuPy arrays for CuPy
    inputs): bf16 activation gradients and fp32 weight gradients, computed on the caller's current
    stream. Inputs are not modified. CPU tensors run the reference: bf16 or float32 inputs in
    float32, float64 inputs in float64 (activation gradients in the inputs' dtype, weight gradients
    in float32, float64 for float64 inputs).
    version None (default): the fastest version that runs on this GPU and shape (v4 on Hopper
    where it applies, else v3); `VERSIONS` lists them all.
    """
    raw = (grad_corrected, hidden_states, activated, prediction_coefs, correction_coefs,
           router_weight, norm_weight)
    named = list(zip(INPUT_NAMES, raw))
    cupy_in = _arrays.check_framework(named)
    inputs = tuple(_arrays.as_tensor(name, x) for name, x in named)
    # Scalars are checked here too: the dispatcher would refuse a wrong type with its own words.
    if inputs[0].dim() >= 1:
        active_idx = _arrays.index_in_range("active_idx", active_idx, inputs[0].shape[0])
    eps = _arrays.positive_finite("eps", eps)
    _registry.check_number(VERSIONS, version)
    if not cupy_in:
        if fast_path_applies(inputs):
            with _device.on(inputs[0].device):
                return PredictCorrectGrads(*_run_cuda(inputs, active_idx, eps, version, fast_path=True))
        return PredictCorrectGrads(*torch.ops.altup_cupy.predict_correct_backward(
            *inputs, active_idx, eps, version))
    with _arrays.cupy_caller_stream(inputs[0].device):
        return PredictCorrectGrads(*map(_arrays.to_cupy, _run_cuda(inputs, active_idx, eps, version)))


def run_plan(make_plan, inputs, active_idx: int, eps: float) -> PredictCorrectGrads:
    """The backward of torch CUDA tensors `inputs` (the seven of `predict_correct_backward`, in its
    order) through a plan of the caller's making, `make_plan(streams, active, tokens, hidden,
    device)`: e.g. `functools.partial(v4_plan, stages=3)` runs v4 with three ring stages (the
    ring-stage sweep, the tests of every stage count). Checked and launched as the public function
    does, on the current stream."""
    with _device.on(inputs[0].device):
        return PredictCorrectGrads(*_run_cuda(tuple(inputs), active_idx, eps, None, make_plan=make_plan))
