"""altup_cupy: CUDA kernels, driven from Python through CuPy, for the AltUp block of Gemma 3n.

    from altup_cupy import collapse, predict_correct_backward

Both take CuPy arrays or torch CUDA tensors, run on the caller's current stream without copying
the inputs, and return the caller's type. Importing the package needs no GPU and compiles
nothing: each CUDA source is compiled by NVRTC on first use and cached by CuPy.
"""

from .collapse import collapse
from .predict_correct import PredictCorrectGrads, predict_correct_backward

__version__ = "0.1.0"

__all__ = ["collapse", "predict_correct_backward", "PredictCorrectGrads", "__version__"]
