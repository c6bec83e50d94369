"""The performance ceilings every speed-of-light figure, table and notebook is measured against.

Datasheet numbers bound what any kernel can reach; the measured ones are what a plain cuBLAS GEMM
and a plain device copy reach on the same GPU (recorded in results/nvidia-h200/spec_baselines.json,
L2 flushed before each timed call, median of CUDA-event times). See docs/SPEC.md, section 4.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ceilings:
    gpu: str
    bf16_flops: float  # datasheet dense bf16 tensor-core FLOP/s
    hbm_bytes_per_s: float  # datasheet HBM bandwidth
    copy_bytes_per_s: float  # measured device-to-device copy, bytes read + written per second
    cublas_bf16_flops: float  # measured cuBLAS bf16 GEMM, 8192 x 8192 x 8192

    def sol_seconds(self, flops: float, compulsory_bytes: float) -> float:
        """Speed of light: the larger of the datasheet compute time and memory time."""
        return max(flops / self.bf16_flops, compulsory_bytes / self.hbm_bytes_per_s)


H200 = Ceilings(gpu="NVIDIA H200", bf16_flops=989.4e12, hbm_bytes_per_s=4.8e12,
                copy_bytes_per_s=4.22e12, cublas_bf16_flops=772.1e12)
