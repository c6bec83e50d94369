"""The predict-correct backward in the benchmark: the default (v4 on these shapes), v3, v2 and v1 against
PyTorch and a copy floor."""

from __future__ import annotations

from functools import lru_cache

import torch

from ..bench import Impl, OpBench
from ..predict_correct import DEFAULT_VERSION, predict_correct_backward
from ..reference import predict_correct_autograd, predict_correct_backward_reference
from ..workloads import Workload, predict_correct_backward_inputs

ARG_NAMES = ("grad_corrected", "hidden_states", "activated", "prediction_coefs", "correction_coefs",
             "router_weight", "norm_weight")


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


def copy_elements(w: Workload) -> int:
    """A bf16 device copy of (3N+2)*M*H/2 elements reads and writes 2 bytes each: it moves exactly
    the compulsory (3N+2)*M*H*2 bytes (22*M*H for N = 3)."""
    return (3 * w.streams + 2) * w.tokens * w.hidden // 2


def _copy_floor(inputs):
    g = inputs["grad_corrected"]
    n, b, s, h = g.shape
    count = (3 * n + 2) * b * s * h // 2
    src = torch.empty(count, dtype=torch.bfloat16, device=g.device)
    dst = torch.empty_like(src)
    src.zero_()

    def run():
        dst.copy_(src)
    return run


IMPLS = (
    Impl("altup_cupy", _ours(DEFAULT_VERSION)),
    Impl("altup_cupy_v3", _ours(3)),
    Impl("altup_cupy_v2", _ours(2)),
    Impl("altup_cupy_v1", _ours(1)),
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
    impls=lambda w: IMPLS,
    flops=flops,
    compulsory_bytes=compulsory_bytes,
)
