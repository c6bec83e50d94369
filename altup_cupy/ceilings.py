"""The H200 SXM's ceilings, defined once: the datasheet's peaks and what was measured on the card
(cuBLAS bf16 GEMM at 8192^3, a device-to-device copy; docs/SPEC.md section 4)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ceilings:
    bf16_flops: float  # datasheet dense bf16 tensor-core FLOP/s
    hbm_bytes_per_s: float  # datasheet HBM3e bandwidth
    copy_bytes_per_s: float  # measured: a device copy (bytes read + written per second)
    cublas_bf16_flops: float  # measured: cuBLAS bf16 GEMM, 8192^3


H200 = Ceilings(bf16_flops=989.4e12, hbm_bytes_per_s=4.8e12, copy_bytes_per_s=4.22e12,
                cublas_bf16_flops=772.1e12)
