"""altup_cupy: CUDA kernels, driven from Python through CuPy, for the AltUp block of Gemma 3n.

    from altup_cupy import collapse, predict_correct_backward

Both take torch tensors or CuPy arrays, run on the caller's current stream without copying the
inputs, and return the caller's type. They are also torch custom operators
(`torch.ops.altup_cupy.collapse`, `torch.ops.altup_cupy.predict_correct_backward`), so
torch.compile traces them without graph breaks and CUDA graphs capture them; `collapse` is
differentiable (its backward is `altup_cupy.torch.collapse`'s). Importing the package
needs no GPU and compiles nothing: each CUDA source is compiled by NVRTC on first use and cached.
"""

from .ops.collapse import collapse
from .ops.predict_correct_backward import PredictCorrectGrads, predict_correct_backward
from . import torch  # noqa: F401,E402  registers the operators' backwards: collapse is differentiable on import

__version__ = "0.2.0"

__all__ = ["collapse", "predict_correct_backward", "PredictCorrectGrads", "__version__"]
