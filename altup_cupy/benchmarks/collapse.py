"""The collapse forward in the benchmark: this package's kernel against PyTorch and cuBLAS."""

from __future__ import annotations

from functools import lru_cache

import torch

from .. import _arrays, _cublas
from ..bench import Impl, OpBench
from ..collapse import collapse
from ..reference import collapse_reference
from ..workloads import Workload, collapse_inputs


def collapse_bf16_gemm_torch(hidden_states, unembed_projs, eps: float):
    """What a plain bf16 model computes: bf16 GEMM outputs, fp32 epilogue. Fails the tolerance
    (docs/SPEC.md section 1: rounding y_k to bf16 leaves ~98.7% of elements within it)."""
    streams = hidden_states.shape[0]
    s0 = hidden_states[0].float()
    target = s0.square().mean(dim=-1, keepdim=True).sqrt()
    total = s0
    for k in range(1, streams):
        y = (hidden_states[k] @ unembed_projs[k - 1].T).float()
        total = total + y * (target / y.square().mean(dim=-1, keepdim=True).clamp_min(eps).sqrt())
    return (total / streams).to(torch.bfloat16)


@lru_cache(maxsize=None)
def _compiled_bf16_gemm():
    return torch.compile(collapse_bf16_gemm_torch, dynamic=True)


def _ours(inputs):
    hs, ws, eps = inputs["hidden_states"], inputs["unembed_projs"], inputs["eps"]
    return lambda: (collapse(hs, ws, eps),)


def _eager_fp32(inputs):
    hs, ws, eps = inputs["hidden_states"], inputs["unembed_projs"], inputs["eps"]
    return lambda: (collapse_reference(hs, ws, eps, torch.float32).to(torch.bfloat16),)


def _eager_bf16_gemm(inputs):
    hs, ws, eps = inputs["hidden_states"], inputs["unembed_projs"], inputs["eps"]
    return lambda: (collapse_bf16_gemm_torch(hs, ws, eps),)


def _compiled_bf16_gemm_impl(inputs):
    hs, ws, eps = inputs["hidden_states"], inputs["unembed_projs"], inputs["eps"]
    compiled = _compiled_bf16_gemm()
    return lambda: (compiled(hs, ws, eps),)


def _cublas_gemms_alone(inputs):
    """The two fp32-output projections exactly as `collapse` issues them, without the epilogue."""
    hs, ws = inputs["hidden_states"], inputs["unembed_projs"]
    streams, batch, seq, hidden = hs.shape
    rows = batch * seq
    y = torch.empty((streams - 1, rows, hidden), dtype=torch.float32, device=hs.device)

    def run():
        with _arrays.caller_stream("torch", hs.device.index):
            _cublas.gemm_bf16_f32(hs.data_ptr() + 2 * rows * hidden, ws.data_ptr(), y.data_ptr(),
                                  rows=rows, n=hidden, k=hidden, batch=streams - 1,
                                  x_batch_stride=rows * hidden, w_batch_stride=hidden * hidden,
                                  y_batch_stride=rows * hidden)
    return run


IMPLS = (
    Impl("altup_cupy", _ours),
    Impl("torch_eager_fp32", _eager_fp32),
    Impl("torch_eager_bf16gemm", _eager_bf16_gemm),
    Impl("torch_compile_bf16gemm", _compiled_bf16_gemm_impl),
    Impl("cublas_gemms_fp32out", _cublas_gemms_alone, checked=False),
)


def flops(w: Workload) -> float:
    return 2.0 * (w.streams - 1) * w.tokens * w.hidden**2


def compulsory_bytes(w: Workload) -> float:
    """Every stream read once, the output written once, each weight read once (bf16)."""
    return 2.0 * ((w.streams + 1) * w.tokens * w.hidden + (w.streams - 1) * w.hidden**2)


COLLAPSE = OpBench(
    op="collapse",
    output_names=("out",),
    make_inputs=lambda w, seed: collapse_inputs(w, seed),
    reference=lambda inputs: (collapse_reference(inputs["hidden_states"], inputs["unembed_projs"], inputs["eps"]),),
    impls=lambda w: IMPLS,
    flops=flops,
    compulsory_bytes=compulsory_bytes,
    oracle_impl="torch_eager_fp32",
)
