# TEMPORARY stub until the kernels branch lands (replaced by its _sources.py).
from ._build import KernelSource
SUPPORTED_STREAMS = (2, 3, 4)
COLLAPSE_CHUNK_CHOICES = (1, 2, 4)
def collapse_max_threads(n, chunks):
    return 1024 if n * chunks <= 4 else 512 if n * chunks <= 8 else 256
COLLAPSE_V1 = KernelSource("collapse.cu", tuple(f"collapse_epilogue_v1<{n}, {c}>" for n in SUPPORTED_STREAMS for c in COLLAPSE_CHUNK_CHOICES))
object.__setattr__(COLLAPSE_V1, "min_arch", 80) if False else setattr(COLLAPSE_V1, "min_arch", 80)
MAX_HIDDEN = 8192
PREDICT_CORRECT_BACKWARD_REDUCE = PREDICT_CORRECT_BACKWARD_V1 = PREDICT_CORRECT_BACKWARD_V2 = PREDICT_CORRECT_BACKWARD_V3 = PREDICT_CORRECT_BACKWARD_V4 = COLLAPSE_V1
V4_STATIC_SHARED_BOUND = 6 * 1024; V4_MIN_STAGES=3; V4_MAX_STAGES=6; V4_MAX_THREADS=352
