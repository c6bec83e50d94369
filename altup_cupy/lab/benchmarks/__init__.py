"""One `OpBench` per op: its inputs, references, implementations and cost model."""

from __future__ import annotations

from ..bench import OpBench


def op_bench(op: str) -> OpBench:
    if op == "collapse":
        from .collapse import COLLAPSE

        return COLLAPSE
    if op == "predict_correct_backward":
        from .predict_correct_backward import PREDICT_CORRECT_BACKWARD

        return PREDICT_CORRECT_BACKWARD
    raise ValueError(f"unknown op {op!r}")
