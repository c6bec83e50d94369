"""The predict-correct backward in the benchmark: every version of this package's op (read off its
registry) against PyTorch and a copy floor."""

from __future__ import annotations

from functools import lru_cache

import torch

from ... import predict_correct_backward
from ..bench import Impl, OpBench, copy_floor
from ...ops.predict_correct_backward import INPUT_NAMES as ARG_NAMES
from ...ops.predict_correct_backward_versions import PREFERENCE, VERSIONS
from ...reference import predict_correct_autograd, predict_correct_backward_reference
from ..workloads import Workload, predict_correct_backward_inputs
from . import versions

def _args(inputs):
    return tuple(inputs[k] for k in ARG_NAMES), inputs["active_idx"], inputs["eps"]


def _contract(grads):
    """Cast fp32 reference outputs to the contract dtypes: bf16 activation grads, fp32 weights."""
    return (grads[0].to(torch.bfloat16), grads[1].to(torch.bfloat16), *(g.float() for g in grads[2:]))


def eager_fp32(*args, active_idx: int = 0, eps: float = 1e-6):
    return _contract(predict_correct_backward_reference(*args, active_idx, eps, torch.float32))


@lru_cache(maxsize=None)
def _compiled():
    return torch.compile(eager_fp32, dynamic=True)


def _ours(version):
    def prepare(inputs):
        args, a, eps = _args(inputs)
        return lambda: tuple(predict_correct_backward(*args, a, eps, version=version))
    return prepare


def _dispatched(inputs):
    """The same op through torch's dispatcher (torch.ops), as torch.compile and autograd reach it."""
    args, a, eps = _args(inputs)
    return lambda: torch.ops.altup_cupy.predict_correct_backward(*args, a, eps)


def _eager(inputs):
    args, a, eps = _args(inputs)
    return lambda: eager_fp32(*args, active_idx=a, eps=eps)


def _autograd(inputs):
    args, a, eps = _args(inputs)
    return lambda: _contract(predict_correct_autograd(*args, a, eps, torch.float32))


def _compile(inputs):
    args, a, eps = _args(inputs)
    fn = _compiled()
    return lambda: fn(*args, active_idx=a, eps=eps)


def _copy_floor(inputs):
    """The compulsory (3N+2)*M*H*2 bytes (22*M*H for N = 3) through a plain device copy."""
    n, b, s, h = inputs["grad_corrected"].shape
    return copy_floor(2 * (3 * n + 2) * b * s * h, inputs["grad_corrected"].device)


BASELINES = (
    Impl("altup_cupy_op", _dispatched),
    Impl("torch_eager", _eager),
    Impl("torch_autograd", _autograd),
    Impl("torch_compile", _compile),
    Impl("copy_floor", _copy_floor, checked=False),
)


def flops(w: Workload) -> float:
    """Nominal: ~(30N + 20) fp32 operations per token and hidden element (reductions, element-wise
    gradients and both router backwards); a bookkeeping number, the op is memory-bound."""
    return float((30 * w.streams + 20) * w.tokens * w.hidden)


def compulsory_bytes(w: Workload) -> float:
    """2N+1 bf16 rows read and N+1 written per token (weights are negligible)."""
    return 2.0 * ((2 * w.streams + 1) + (w.streams + 1)) * w.tokens * w.hidden


def _reference(inputs):
    args, a, eps = _args(inputs)
    return tuple(predict_correct_backward_reference(*args, a, eps, torch.float64))


PREDICT_CORRECT_BACKWARD = OpBench(
    op="predict_correct_backward",
    output_names=("grad_hidden_states", "grad_activated", "grad_prediction_coefs",
                  "grad_correction_coefs", "grad_router_weight", "grad_norm_weight"),
    make_inputs=lambda w, seed: predict_correct_backward_inputs(w, seed),
    reference=_reference,
    impls=lambda w: versions.impls(VERSIONS, PREFERENCE, _ours, w) + BASELINES,
    flops=flops,
    compulsory_bytes=compulsory_bytes,
)
