"""The collapse forward in the benchmark: every version of this package's op against PyTorch, and
the projection GEMMs alone three ways: as v1 issues them (cuBLASLt, planned once per shape), through
torch.bmm(..., out_dtype=float32), and through CuPy's cuBLAS binding (how the package issued them
before; that binding refuses to run during CUDA-graph capture)."""

from __future__ import annotations

from functools import lru_cache

import torch

from ... import _cublas, collapse
from ..bench import Impl, OpBench
from ...ops.collapse_versions import PREFERENCE, VERSIONS
from ...reference import collapse_reference
from ..workloads import Workload, collapse_inputs
from . import cupy_cublas, versions


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


def _ours(version):
    def prepare(inputs):
        hs, ws, eps = inputs["hidden_states"], inputs["unembed_projs"], inputs["eps"]
        return lambda: (collapse(hs, ws, eps, version=version),)
    return prepare


def _dispatched(inputs):
    """The same op through torch's dispatcher (torch.ops), as torch.compile and autograd reach it."""
    hs, ws, eps = inputs["hidden_states"], inputs["unembed_projs"], inputs["eps"]
    return lambda: (torch.ops.altup_cupy.collapse(hs, [ws], eps),)


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


def _projection_operands(inputs):
    hs, ws = inputs["hidden_states"], inputs["unembed_projs"]
    streams, batch, seq, hidden = hs.shape
    x = hs.view(streams, batch * seq, hidden)[1:]
    y = torch.empty((streams - 1, batch * seq, hidden), dtype=torch.float32, device=hs.device)
    return x, ws, y


def _gemms_alone(inputs):
    """The fp32-output projections exactly as v1 issues them, without the epilogue."""
    x, ws, y = _projection_operands(inputs)
    batch, rows, hidden = x.shape
    gemm = _cublas.Gemm(rows=rows, cols=hidden, inner=hidden, batch=batch, x_batch_stride=x.stride(0),
                        y_batch_stride=ws.stride(0), d_batch_stride=y.stride(0))
    workspace = torch.empty(gemm.workspace_bytes, dtype=torch.uint8, device=x.device)
    return lambda: gemm(x.data_ptr(), ws.data_ptr(), y.data_ptr(), workspace.data_ptr(),
                        torch.cuda.current_stream().cuda_stream)


def _torch_gemms_alone(inputs):
    """The same projections through torch.bmm with an fp32 output (cuBLAS as torch calls it)."""
    x, ws, y = _projection_operands(inputs)
    return lambda: torch.bmm(x, ws.transpose(1, 2), out_dtype=torch.float32, out=y)


def _cupy_cublas_gemms_alone(inputs):
    """The same projections through CuPy's cuBLAS binding (the package's first GEMM path, which
    CUDA graphs cannot capture)."""
    x, ws, y = _projection_operands(inputs)
    return lambda: cupy_cublas.gemm_bf16_f32(x, ws, y)


BASELINES = (
    Impl("altup_cupy_op", _dispatched),
    Impl("torch_eager_fp32", _eager_fp32),
    Impl("torch_eager_bf16gemm", _eager_bf16_gemm),
    Impl("torch_compile_bf16gemm", _compiled_bf16_gemm_impl),
    Impl("cublas_gemms_fp32out", _gemms_alone, checked=False),
    Impl("bmm_gemms_fp32out", _torch_gemms_alone, checked=False),
    Impl("cupy_cublas_gemms_fp32out", _cupy_cublas_gemms_alone, checked=False),
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
    impls=lambda w: versions.impls(VERSIONS, PREFERENCE, _ours, w) + BASELINES,
    flops=flops,
    compulsory_bytes=compulsory_bytes,
    oracle_impl="torch_eager_fp32",
)
