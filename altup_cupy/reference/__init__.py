"""Plain PyTorch implementations of docs/SPEC.md, written for clarity, in any floating dtype.

In float64 they are the references every kernel is checked against; in float32 they are the
"plain PyTorch implementation at working precision" of the accuracy oracle and the eager
baselines of the benchmark. They run on whatever device their inputs are on.
"""

from .collapse import collapse_reference
from .predict_correct import (
    BackwardStages,
    PredictCorrectGrads,
    predict_correct_autograd,
    predict_correct_backward_one_reduction,
    predict_correct_backward_reference,
    predict_correct_backward_stages,
    predict_correct_forward,
)

__all__ = [
    "collapse_reference",
    "predict_correct_forward",
    "predict_correct_backward_reference",
    "predict_correct_backward_one_reduction",
    "predict_correct_backward_stages",
    "predict_correct_autograd",
    "BackwardStages",
    "PredictCorrectGrads",
]
