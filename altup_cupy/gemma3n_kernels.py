"""The CUDA side of Gemma 3n's AltUp steps: kernel sources and launchers on torch CUDA tensors.

Each launcher takes bf16 CUDA tensors already validated by `gemma3n_ops` (contiguous, 16-byte
aligned rows, H % 8 == 0, 2 <= N <= 4) and runs on torch's current stream of the tensors'
device. The projection GEMMs of the expansion and collapse run in cuBLAS through torch
(`torch.mm(..., out_dtype=torch.float32)`: bf16 inputs, fp32 accumulation and output, so the
projections are never rounded before the epilogue). Weight gradients are written per block and
summed in a fixed order by `altup_column_sum_v1`: every result is bitwise deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ._build import KernelSource

STREAMS = (2, 3, 4)
# One block per token holds a row in H / 8 threads (kernels/altup_rows.cuh: kRowThreadsMax).
ROW_THREADS_MAX = 384
MAX_HIDDEN = 8 * ROW_THREADS_MAX
# Blocks of the backward kernels per SM: enough tokens in flight to cover the memory latency,
# few enough that the partials stay small.
BACKWARD_BLOCKS_PER_SM = 4


@dataclass
class _RowsSource(KernelSource):
    """A kernels/ source that also includes kernels/altup_rows.cuh (pasted, like common.cuh)."""

    def code(self) -> str:
        rows = (self.path().parent / "altup_rows.cuh").read_text()
        return super().code().replace('#include "altup_rows.cuh"', f"// ---- altup_rows.cuh ----\n{rows}")

    def path(self):
        from ._build import SOURCE_DIR

        return SOURCE_DIR / self.filename


def _per_active(kernel: str) -> tuple[str, ...]:
    return tuple(f"{kernel}<{n}, {a}>" for n in STREAMS for a in range(n))


PREDICT_SOURCE = _RowsSource(
    "kernels/altup_predict_v1.cu",
    _per_active("altup_predict_forward_v1") + _per_active("altup_predict_backward_v1"),
)
CORRECT_SOURCE = _RowsSource(
    "kernels/altup_correct_v1.cu",
    _per_active("altup_correct_forward_v1") + _per_active("altup_correct_backward_v1"),
)
MAGNITUDE_MATCH_SOURCE = _RowsSource(
    "kernels/altup_magnitude_match_v1.cu",
    tuple(f"altup_expand_forward_v1<{n}>" for n in STREAMS)
    + tuple(f"altup_magnitude_match_backward_v1<{n}, {t}>" for n in STREAMS for t in ("float", "unsigned short")),
)
COLUMN_SUM_SOURCE = KernelSource("kernels/altup_column_sum_v1.cu", ("altup_column_sum_v1",))
SOURCES = (PREDICT_SOURCE, CORRECT_SOURCE, MAGNITUDE_MATCH_SOURCE, COLUMN_SUM_SOURCE)
