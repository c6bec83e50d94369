"""The backward of AltUp's predict + correct step (docs/SPEC.md section 2): six gradients.

`predict_correct_backward(...)` is the public function; `torch.ops.altup_cupy.predict_correct_backward`
the torch custom operator behind it (fake implementation for torch.compile, the kernels on CUDA,
the float32 reference on the CPU). Eager calls on CUDA tensors that need no autograd take the fast
path: validated inputs go straight to the cached launch plan of their shape.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from .. import _arrays, _device
from .._sources import SUPPORTED_STREAMS
from ..reference import predict_correct_backward_reference
from . import _registry
from .collapse import _fast_path_applies
from .predict_correct_backward_versions import MAX_HIDDEN, PREFERENCE, VERSIONS

BF16, F32 = torch.bfloat16, torch.float32
INPUT_NAMES = ("grad_corrected", "hidden_states", "activated", "prediction_coefs", "correction_coefs",
               "router_weight", "norm_weight")


class PredictCorrectGrads(NamedTuple):
    grad_hidden_states: Any  # bf16 [N, B, S, H]
    grad_activated: Any  # bf16 [B, S, H]
    grad_prediction_coefs: Any  # fp32 [N*N, N]
    grad_correction_coefs: Any  # fp32 [N, N]
    grad_router_weight: Any  # fp32 [N, H]
    grad_norm_weight: Any  # fp32 [H]


def validate(g, hs, act, P, Q, R, w, active_idx, eps, launching: bool = False):
    """Named errors for anything the kernels cannot take; returns (N, B, S, H, a, eps, device).
    launching: the tensors are about to be read by the kernels (real CUDA memory), so their
    addresses are checked too."""
    _arrays.check_tensor("grad_corrected", g, BF16, (None, None, None, None), "N B S H")
    streams, batch, seq, hidden = g.shape
    if streams not in SUPPORTED_STREAMS:
        raise ValueError(f"grad_corrected must hold N in {SUPPORTED_STREAMS} streams (dim 0), got {streams}")
    if hidden % 8:
        raise ValueError(f"hidden size H (grad_corrected dim 3) must be divisible by 8, got {hidden}")
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size H (grad_corrected dim 3) must be at most {MAX_HIDDEN}, got {hidden}")
    n = streams
    expected = ((streams, batch, seq, hidden, "N B S H"), (batch, seq, hidden, "B S H"),
                (n * n, n, "N*N N"), (n, n, "N N"), (n, hidden, "N H"), (hidden, "H"))
    named = [("grad_corrected", g)]
    for name, t, shape in zip(INPUT_NAMES[1:], (hs, act, P, Q, R, w), expected):
        _arrays.check_tensor(name, t, BF16, shape[:-1], shape[-1])
        named.append((name, t))
    a = _arrays.index_in_range("active_idx", active_idx, streams)
    eps = _arrays.positive_finite("eps", eps)
    device = _arrays.check_devices(named)
    if launching:
        _arrays.check_aligned([named[i] for i in (0, 1, 2, 5, 6)])  # the rows read 16 bytes at a time
    return streams, batch, seq, hidden, a, eps, device


def _empty_grads(streams, batch, seq, hidden, device):
    def new(shape, dtype):
        return torch.empty(shape, dtype=dtype, device=device)
    return (new((streams, batch, seq, hidden), BF16), new((batch, seq, hidden), BF16),
            new((streams * streams, streams), F32), new((streams, streams), F32),
            new((streams, hidden), F32), new((hidden,), F32))


def _run_cuda(inputs, active_idx, eps, version):
    streams, batch, seq, hidden, a, eps, device = validate(*inputs, active_idx, eps, launching=True)
    outs = _empty_grads(streams, batch, seq, hidden, device)
    tokens = batch * seq
    if tokens == 0:
        for weight_grad in outs[2:]:
            weight_grad.zero_()
        return outs
    index = device.index
    plan = _version(version, streams, hidden, index).plan(streams, a, tokens, hidden, index)
    plan(inputs, outs, eps, torch._C._cuda_getCurrentRawStream(index))
    return outs


@functools.lru_cache(maxsize=256)
def _version(version, streams: int, hidden: int, index: int):
    """The version that serves this call, picked once per shape (its plans are cached by the
    version itself: v4's depend on a tuning override too)."""
    capability, name = _device.facts(index)
    return _registry.pick(VERSIONS, PREFERENCE, version, capability, streams, hidden, name)


@torch.library.custom_op("altup_cupy::predict_correct_backward", mutates_args=(), device_types="cuda")
def predict_correct_backward_op(
        grad_corrected: torch.Tensor, hidden_states: torch.Tensor, activated: torch.Tensor,
        prediction_coefs: torch.Tensor, correction_coefs: torch.Tensor, router_weight: torch.Tensor,
        norm_weight: torch.Tensor, active_idx: int, eps: float, version: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    inputs = (grad_corrected, hidden_states, activated, prediction_coefs, correction_coefs,
              router_weight, norm_weight)
    with _device.on(grad_corrected.device):
        return _run_cuda(inputs, active_idx, eps, version)


@predict_correct_backward_op.register_kernel("cpu")
def _predict_correct_backward_cpu(*args):
    inputs, active_idx, eps = args[:7], args[7], args[8]
    validate(*inputs, active_idx, eps)
    _registry.check_number(VERSIONS, args[9] if len(args) > 9 else None)
    grads = predict_correct_backward_reference(*inputs, active_idx, eps, F32)
    return (grads[0].to(BF16), grads[1].to(BF16), *(g.float().contiguous() for g in grads[2:]))


@predict_correct_backward_op.register_fake
def _predict_correct_backward_fake(*args):
    inputs, active_idx, eps = args[:7], args[7], args[8]
    streams, batch, seq, hidden, _, _, _ = validate(*inputs, active_idx, eps)
    _registry.check_number(VERSIONS, args[9] if len(args) > 9 else None)
    g = inputs[0]
    return (g.new_empty((streams, batch, seq, hidden)), g.new_empty((batch, seq, hidden)),
            g.new_empty((streams * streams, streams), dtype=F32), g.new_empty((streams, streams), dtype=F32),
            g.new_empty((streams, hidden), dtype=F32), g.new_empty((hidden,), dtype=F32))


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
    stream. Inputs are not modified. CPU tensors run the float32 reference.
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
        if _fast_path_applies(inputs):
            with _device.on(inputs[0].device):
                return PredictCorrectGrads(*_run_cuda(inputs, active_idx, eps, version))
        return PredictCorrectGrads(*torch.ops.altup_cupy.predict_correct_backward(
            *inputs, active_idx, eps, version))
    with _arrays.cupy_caller_stream(inputs[0].device):
        return PredictCorrectGrads(*map(_arrays.to_cupy, _run_cuda(inputs, active_idx, eps, version)))
