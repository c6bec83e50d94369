"""The package's CUDA sources, in one list, and the launch constants the host and the kernels share.

Each constant below is defined here only: the kernels receive it as an `ALTUP_<NAME>` -D define
(see `defines` of each source), the host modules import it from here. Layout sizes that the
kernels derive themselves (TokenStats<N>::size, partial_stride) are passed in the same way and
checked by a `static_assert` in the kernel source, so a drift between host and device fails to
compile. tests/test_sources.py checks that every define a source uses is given to it.
"""

from __future__ import annotations

from ._build import KernelSource
from ._launch import ceil_div

SUPPORTED_STREAMS = (2, 3, 4)

# ---- collapse -----------------------------------------------------------------------------------

COLLAPSE_CHUNK_CHOICES = (1, 2, 4)  # 16-byte slices of the row per thread and sweep
# (most slices N * CHUNKS a thread holds, threads per block): a thread's share of the 65536
# registers of an SM must hold them. The last tier covers every instantiation (4 * 4 slices).
COLLAPSE_LAUNCH_BOUNDS = ((4, 1024), (8, 512), (16, 256))


def collapse_max_threads(streams: int, chunks: int) -> int:
    """The `__launch_bounds__` of collapse_epilogue_v1<streams, chunks>."""
    return next(threads for most, threads in COLLAPSE_LAUNCH_BOUNDS if streams * chunks <= most)


# ---- predict-correct backward -------------------------------------------------------------------

REDUCE_THREADS = 1024  # predict_correct_backward_reduce: 32 warps over 32 columns
V1_THREADS = 256
V1_STAGES = ("forward_stats", "correction_grads", "correct_router_bwd", "prediction_grads",
             "predict_router_bwd", "elementwise", "weight_grads", "coef_grads")
# v2: threads of the resident kernel (rows staged on chip, one slice per thread) per N; the
# non-resident kernel takes NONRESIDENT_SLICES slices per thread on at most NONRESIDENT_THREADS.
V2_RESIDENT_THREADS = {2: 320, 3: 320, 4: 256}
V2_NONRESIDENT_THREADS = 256
NONRESIDENT_SLICES = (2, 4)
# v3 instantiations: (slices per thread, min blocks per SM), and the launch bounds of each
# occupancy: two blocks per SM (H <= 2560), one block.
V3_VARIANTS = ((1, 2), (1, 1), (2, 1))


def v3_variants(streams: int) -> tuple[tuple[int, int], ...]:
    """The v3 variants built for N = `streams`: at N = 4 the one-slice one-block variant (512
    threads, so 128 registers a thread) spills on sm_80-sm_89, so H > 2560 takes two slices."""
    return tuple(v for v in V3_VARIANTS if not (streams == 4 and v == (1, 1)))
V3_TWO_BLOCK_THREADS = 320
V3_ONE_BLOCK_THREADS = 512
# The ring kernels (v4, v6): at most RING_MAX_STAGES ring stages. v4: one 8-element slice per
# compute thread plus the scalar warp (H <= 2560); v6: one 4-element half slice per compute thread
# (H <= 2432 in V6_MAX_THREADS: 20 warps, 5 a scheduler, 96 registers a thread). The static-shared
# bounds (RingShared<N, columns> and the stage barriers: 5.4 KiB for v4 at N = 4, 4.1 KiB for v6
# at N = 3) let the host decide without a GPU whether a ring fits.
RING_MAX_STAGES = 6
V4_MAX_THREADS = 352
V4_STATIC_SHARED_BOUND = 6 * 1024
V6_MAX_THREADS = 640
V6_STATIC_SHARED_BOUND = 5 * 1024
# At N = 4 v6 spills under its 96-register cap (the scalar phase's N x N matrices): N = 4 runs v4.
V6_STREAMS = (2, 3)


def token_stats_size(streams: int) -> int:
    """Floats per token in v1's scratch (TokenStats<N>::size)."""
    return 2 + 6 * streams + 2 * streams * streams


def partial_stride(streams: int, hidden: int) -> int:
    """Floats in one block's weight-gradient partials: dR [N*H] | dw [H] in fp32, then dP [N^3] |
    dQ [N^2] in fp64, two floats each (kernels/weight_grad_partials.cuh says why). A multiple of 4
    (H is a multiple of 8, 2 N^2 (N + 1) one of 4): the reductions read 16-byte columns."""
    return (streams + 1) * hidden + 2 * (streams**3 + streams**2)


def reduce_blocks(streams: int, hidden: int) -> int:
    """Grid of predict_correct_backward_reduce<streams>: a block per 32 float4 columns of the
    partials' fp32 part, then a block per 32 fp64 coefficient-gradient entries."""
    return ceil_div((streams + 1) * hidden, 4 * 32) + ceil_div(streams**3 + streams**2, 32)


def _per_stream(name: str, value) -> dict[str, int]:
    return {f"{name}_{n}": value(n) for n in SUPPORTED_STREAMS}


_PARTIALS = _per_stream("PARTIAL_COEF_FLOATS", lambda n: partial_stride(n, 0))
_COLLAPSE = {f"COLLAPSE_{kind}_{tier}": value for tier, bound in enumerate(COLLAPSE_LAUNCH_BOUNDS)
             for kind, value in zip(("SLICES", "THREADS"), bound)}


COLLAPSE_V1 = KernelSource(
    "collapse_v1.cu",
    tuple(f"collapse_epilogue_v1<{n}, {c}>" for n in SUPPORTED_STREAMS for c in COLLAPSE_CHUNK_CHOICES),
    min_arch=80,
    defines=_COLLAPSE,
)

# collapse v2 and v3 (Hopper GEMM, collapse_gemm_sm90.cuh): a CTA computes a BLOCK_M x BLOCK_N tile of
# y_k, BLOCK_K of the reduction per ring stage (64 bf16 = one 128-byte swizzle row), STAGES stages
# deep; CONSUMERS warpgroups of 64 rows each plus one producer warpgroup; up to MAX_PROJECTIONS =
# N-1 streams.
COLLAPSE_GEMM_TILE = {"COLLAPSE_V2_BLOCK_M": 128, "COLLAPSE_V2_BLOCK_N": 256, "COLLAPSE_V2_BLOCK_K": 64,
                      "COLLAPSE_V2_STAGES": 4, "COLLAPSE_V2_CONSUMERS": 2, "COLLAPSE_V2_SWIZZLE_ALIGN": 1024,
                      "COLLAPSE_V2_MAX_PROJECTIONS": 3}
COLLAPSE_V3_EPILOGUE_MAX_THREADS = 512


def collapse_gemm(mode: int) -> str:
    """The GEMM's instantiation of one epilogue mode: 0 stores y_k (v2), 1 also its row statistics
    (v3)."""
    return f"collapse_gemm_sm90<{mode}>"


# Hopper only (sm_90a): TMA, wgmma, setmaxnreg. Each version's GEMM mode, v2's K-split sum and
# v3's epilogue.
COLLAPSE_V2 = KernelSource("collapse_v2.cu", (collapse_gemm(0), "collapse_split_sum"), min_arch=90,
                           defines=COLLAPSE_GEMM_TILE, needs_sm90a=True)
COLLAPSE_V3 = KernelSource(
    "collapse_v3.cu", (collapse_gemm(1), *(f"collapse_epilogue_v3<{n}>" for n in SUPPORTED_STREAMS)), min_arch=90,
    defines={**COLLAPSE_GEMM_TILE, "COLLAPSE_V3_EPILOGUE_MAX_THREADS": COLLAPSE_V3_EPILOGUE_MAX_THREADS},
    needs_sm90a=True)

PREDICT_CORRECT_BACKWARD_REDUCE = KernelSource(
    "predict_correct_backward_reduce.cu",
    tuple(f"predict_correct_backward_reduce<{n}>" for n in SUPPORTED_STREAMS),
    min_arch=80,
    defines={"REDUCE_THREADS": REDUCE_THREADS, **_PARTIALS},
)

PREDICT_CORRECT_BACKWARD_V1 = KernelSource(
    "predict_correct_backward_v1.cu",
    tuple(f"predict_correct_backward_v1_{stage}<{n}>" for n in SUPPORTED_STREAMS for stage in V1_STAGES),
    min_arch=80,
    defines={"V1_THREADS": V1_THREADS, **_PARTIALS, **_per_stream("TOKEN_STATS_SIZE", token_stats_size)},
)

PREDICT_CORRECT_BACKWARD_V2 = KernelSource(
    "predict_correct_backward_v2.cu",
    tuple(f"predict_correct_backward_v2<{n}, {a}, {slices}, {'true' if resident else 'false'}>"
          for n in SUPPORTED_STREAMS for a in range(n)
          for slices, resident in ((1, True), *((s, False) for s in NONRESIDENT_SLICES))),
    min_arch=80,
    defines={**_per_stream("V2_RESIDENT_THREADS", V2_RESIDENT_THREADS.__getitem__),
             "V2_NONRESIDENT_THREADS": V2_NONRESIDENT_THREADS, **_PARTIALS},
)

PREDICT_CORRECT_BACKWARD_V3 = KernelSource(
    "predict_correct_backward_v3.cu",
    tuple(f"predict_correct_backward_v3<{n}, {a}, {slices}, {blocks}>"
          for n in SUPPORTED_STREAMS for a in range(n) for slices, blocks in v3_variants(n)),
    min_arch=80,
    defines={"V3_TWO_BLOCK_THREADS": V3_TWO_BLOCK_THREADS, "V3_ONE_BLOCK_THREADS": V3_ONE_BLOCK_THREADS,
             **_PARTIALS},
)


def _ring_backward(version: int, streams: tuple[int, ...], max_threads: int,
                   static_shared_bound: int) -> KernelSource:
    """A ring kernel of the backward (v4, v6: kernels/predict_correct_backward_v<version>.cu,
    <N, active index>), Hopper only (cp.async.bulk and mbarrier)."""
    kernel = f"predict_correct_backward_v{version}"
    return KernelSource(
        f"{kernel}.cu", tuple(f"{kernel}<{n}, {a}>" for n in streams for a in range(n)), min_arch=90,
        defines={f"V{version}_MAX_THREADS": max_threads, "RING_MAX_STAGES": RING_MAX_STAGES,
                 f"V{version}_STATIC_SHARED_BOUND": static_shared_bound, **_PARTIALS})


PREDICT_CORRECT_BACKWARD_V4 = _ring_backward(4, SUPPORTED_STREAMS, V4_MAX_THREADS, V4_STATIC_SHARED_BOUND)
PREDICT_CORRECT_BACKWARD_V6 = _ring_backward(6, V6_STREAMS, V6_MAX_THREADS, V6_STATIC_SHARED_BOUND)

# ---- Gemma 3n's AltUp steps (altup_cupy.torch, altup_cupy.gemma3n) ----------------------------

# One block per token holds a row in H / 8 threads: H <= 8 * ROW_THREADS_MAX (3072; Gemma 3n has
# 2048 and 2560), and the launch bounds leave room for N = 4's registers.
ROW_THREADS_MAX = 384
_ROWS = {"ROW_THREADS_MAX": ROW_THREADS_MAX}


def _per_active(kernel: str, *fixed: str) -> tuple[str, ...]:
    return tuple(f"{kernel}<{', '.join((str(n), str(a), *fixed))}>" for n in SUPPORTED_STREAMS for a in range(n))


def _routed_backward(step: str, version: int) -> KernelSource:
    """Version `version` of the predict or correct backward, kernels/altup_<step>_v<version>.cu:
    <N, active index, whether grad_active is given>."""
    kernel = f"altup_{step}_v{version}"
    return KernelSource(f"{kernel}.cu", tuple(name for given in ("false", "true") for name in _per_active(kernel, given)),
                        min_arch=80, defines=_ROWS)


def _magnitude_match_backward(version: int) -> KernelSource:
    """Version `version` of the magnitude match's backward: <N, the base row gradient's type>."""
    kernel = f"altup_magnitude_match_backward_v{version}"
    return KernelSource(f"{kernel}.cu", tuple(f"{kernel}<{n}, {t}>" for n in SUPPORTED_STREAMS
                                              for t in ("float", "unsigned short")), min_arch=80, defines=_ROWS)


ALTUP_PREDICT_FORWARD_V1 = KernelSource("altup_predict_forward_v1.cu", _per_active("altup_predict_forward_v1"),
                                        min_arch=80, defines=_ROWS)
ALTUP_PREDICT_BACKWARD_V1 = _routed_backward("predict_backward", 1)
ALTUP_PREDICT_BACKWARD_V2 = _routed_backward("predict_backward", 2)
ALTUP_PREDICT_BACKWARD_V3 = _routed_backward("predict_backward", 3)
ALTUP_PREDICT_BACKWARD_V4 = _routed_backward("predict_backward", 4)
ALTUP_CORRECT_FORWARD_V1 = KernelSource("altup_correct_forward_v1.cu", _per_active("altup_correct_forward_v1"),
                                        min_arch=80, defines=_ROWS)
ALTUP_CORRECT_BACKWARD_V1 = _routed_backward("correct_backward", 1)
ALTUP_CORRECT_BACKWARD_V2 = _routed_backward("correct_backward", 2)
ALTUP_CORRECT_BACKWARD_V3 = _routed_backward("correct_backward", 3)
ALTUP_EXPAND_FORWARD_V1 = KernelSource("altup_expand_forward_v1.cu",
                                       tuple(f"altup_expand_forward_v1<{n}>" for n in SUPPORTED_STREAMS),
                                       min_arch=80, defines=_ROWS)
ALTUP_MAGNITUDE_MATCH_BACKWARD_V1 = _magnitude_match_backward(1)
ALTUP_MAGNITUDE_MATCH_BACKWARD_V2 = _magnitude_match_backward(2)
ALTUP_ROUTER_GRADS_V1 = KernelSource(
    "altup_router_grads_v1.cu", tuple(f"altup_router_grads_v1<{n}>" for n in SUPPORTED_STREAMS), min_arch=80)

ALL_SOURCES = (
    COLLAPSE_V1,
    COLLAPSE_V2,
    COLLAPSE_V3,
    PREDICT_CORRECT_BACKWARD_REDUCE,
    PREDICT_CORRECT_BACKWARD_V1,
    PREDICT_CORRECT_BACKWARD_V2,
    PREDICT_CORRECT_BACKWARD_V3,
    PREDICT_CORRECT_BACKWARD_V4,
    PREDICT_CORRECT_BACKWARD_V6,
    ALTUP_PREDICT_FORWARD_V1,
    ALTUP_PREDICT_BACKWARD_V1,
    ALTUP_PREDICT_BACKWARD_V2,
    ALTUP_PREDICT_BACKWARD_V3,
    ALTUP_PREDICT_BACKWARD_V4,
    ALTUP_CORRECT_FORWARD_V1,
    ALTUP_CORRECT_BACKWARD_V1,
    ALTUP_CORRECT_BACKWARD_V2,
    ALTUP_CORRECT_BACKWARD_V3,
    ALTUP_EXPAND_FORWARD_V1,
    ALTUP_MAGNITUDE_MATCH_BACKWARD_V1,
    ALTUP_MAGNITUDE_MATCH_BACKWARD_V2,
    ALTUP_ROUTER_GRADS_V1,
)
