"""Host side of the AltUp predict-correct backward (docs/SPEC.md section 2).

Default: v4 where it applies (H <= 2560: one slice per thread and its shared-memory ring fit), otherwise v3.
v4: `pc_v4_fused`: v3's arithmetic with each token's rows streamed into a ring of shared-memory
stages by the bulk-copy engine (cp.async.bulk completing on an mbarrier), two tokens ahead of the
compute, and the per-token scalar phase on a dedicated warp one token behind the compute warps;
one block per SM; the same partials and reduction as v3.
v3: `pc_v3_fused` in predict_correct_bwd.cu: one pass over memory on a persistent grid
(two blocks per SM for H <= 2560; block b handles tokens b, b + G, ...) with ONE block reduction
per token, writing per-block partials of the weight gradients that `pc_reduce_partials` sums in
a fixed order (bitwise deterministic).
v2: `pc_v2_fused`, the first fused version: three reduction rounds per token, rows staged by
cp.async (resident) when one slice per thread covers H, re-read otherwise.
v1 (teaching): one small kernel per derivation stage with intermediates in global scratch.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import numpy

from . import _arrays
from ._arrays import BF16, F32
from ._build import KernelSource
from .reference.predict_correct import PredictCorrectGrads

SUPPORTED_STREAMS = (2, 3, 4)
# v3 instantiations: (slices per thread, min blocks per SM); launch bound 320 threads for two
# blocks per SM (H <= 2560), 512 for one.
V3_VARIANTS = ((1, 2), (1, 1), (2, 1))
VERSIONS = (1, 2, 3, 4)
DEFAULT_VERSION = None  # v4 where it applies (v4_supported: H <= 2560), else v3
MAX_HIDDEN = 8192  # v2: 4 slices of 8 per thread x 256 threads; v3: 2 x 512
# v4: one slice per compute thread plus the scalar warp, at most V4_MAX_THREADS (kV4MaxThreads in
# the .cu: H <= 2560); 3 to V4_MAX_STAGES ring stages (kV4MaxStages in the .cu).
V4_MAX_THREADS = 352
V4_MIN_STAGES = 3  # token j in pass 1, token j - 1 in pass 2, and one arriving
V4_MAX_STAGES = 6
# Hopper's shared memory: 228 KiB per SM, at most 227 KiB per block, 1 KiB reserved per block.
SHARED_PER_SM = 228 * 1024
SHARED_PER_BLOCK = 227 * 1024
SHARED_RESERVED_PER_BLOCK = 1024
# A bound on v4's static shared memory (V4Shared<N> and the stage barriers: 5.1 KiB for N = 4)
# for deciding without a GPU whether v4 applies; launches use the compiled kernel's own number.
V4_STATIC_SHARED_BOUND = 6 * 1024
RESIDENT_THREADS = {2: 320, 3: 320, 4: 256}  # launch bounds of the resident v2 kernels
NONRESIDENT_THREADS = 256
NONRESIDENT_SLICES = (2, 4)
V1_THREADS = 256
V1_MAX_CHUNKS = 256  # token chunks of the v1 weight-gradient reductions

V1_STAGES = ("forward_stats", "correction_grads", "correct_router_bwd", "prediction_grads",
             "predict_router_bwd", "elementwise", "weight_grads", "coef_grads")


def _name_expressions() -> tuple[str, ...]:
    names = []
    for n in SUPPORTED_STREAMS:
        names.append(f"pc_reduce_partials<{n}>")
        names += [f"pc_v1_{stage}<{n}>" for stage in V1_STAGES]
        for a in range(n):
            names.append(f"pc_v2_fused<{n}, {a}, 1, true>")
            names += [f"pc_v2_fused<{n}, {a}, {s}, false>" for s in NONRESIDENT_SLICES]
            names += [f"pc_v3_fused<{n}, {a}, {s}, {b}>" for s, b in V3_VARIANTS]
            names.append(f"pc_v4_fused<{n}, {a}>")
    return tuple(names)


SOURCE = KernelSource("predict_correct_bwd.cu", _name_expressions())


def partial_stride(streams: int, hidden: int) -> int:
    """Floats in one block's weight-gradient partials: dR [N*H] | dw [H] | dP [N^3] | dQ [N^2].
    A multiple of 4 (H is a multiple of 8, N^2 (N + 1) one of 4): pc_reduce_partials reads float4."""
    return (streams + 1) * hidden + streams**3 + streams**2


def token_stats_size(streams: int) -> int:
    """Floats per token in v1's scratch (TokenStats<N>::size in the .cu)."""
    return 2 + 6 * streams + 2 * streams * streams


def v2_launch_shape(streams: int, hidden: int) -> tuple[int, bool, int]:
    """(slices per thread, resident, threads per block) of the v2 kernel for this N and H.

    v2 gives thread i the coefficient-gradient entry i, so a block has at least N^3 + N^2 threads.
    """
    slices = hidden // 8
    min_threads = -(-(streams**3 + streams**2) // 32) * 32
    if slices <= RESIDENT_THREADS[streams]:
        return 1, True, max(min_threads, -(-slices // 32) * 32)
    for per_thread in NONRESIDENT_SLICES:
        threads = -(-slices // per_thread)
        if threads <= NONRESIDENT_THREADS:
            return per_thread, False, max(min_threads, -(-threads // 32) * 32)
    raise ValueError(f"hidden size H must be at most {MAX_HIDDEN}, got {hidden}")


def v2_shared_bytes(streams: int, per_thread: int, resident: bool, threads: int) -> int:
    """Dynamic shared memory: fp32 accumulators, then (resident) the cp.async prefetch stage."""
    acc = (streams + 1) * per_thread * 8 * threads * 4
    stage = (2 * streams + 1) * per_thread * threads * 16 if resident else 0
    return acc + 2 * stage


@functools.lru_cache(maxsize=None)
def _sm_count(device: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])


def _blocks_per_sm(registers: int, threads: int, shared_bytes: int, cap: int = 2) -> int:
    """Resident blocks per SM on Hopper: registers are allocated per warp in units of 256
    (64K per SM, at most 64 warps), shared memory per block plus 1 KiB reserved (228 KiB per SM)."""
    warps = -(-threads // 32)
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = min(64, 65536 // per_warp) // warps
    by_smem = (228 * 1024) // (shared_bytes + 1024)
    by_threads = 2048 // threads
    return max(1, min(by_regs, by_smem, by_threads, cap))


_OCCUPANCY: dict = {}


def _occupancy(kernel, threads: int, shared: int, cap: int, carveout_shared: bool = False) -> int:
    """Blocks per SM of `kernel` at this launch shape, once per kernel and shape. Also lets the
    kernel use `shared` bytes of dynamic shared memory: past 48 KiB, static included, a kernel
    must opt in. carveout_shared: ask for the largest shared-memory carveout of L1 (for a kernel
    that reads through shared memory rather than L1; the driver's default split can be smaller)."""
    key = (kernel, threads, shared, cap)
    per_sm = _OCCUPANCY.get(key)
    if per_sm is None:
        if kernel.max_dynamic_shared_size_bytes < shared:
            kernel.max_dynamic_shared_size_bytes = shared
        if carveout_shared:
            kernel.preferred_shared_memory_carveout = 100
        per_sm = _OCCUPANCY[key] = _blocks_per_sm(kernel.num_regs, threads,
                                                  shared + kernel.shared_size_bytes, cap)
    return per_sm


def v3_launch_shape(hidden: int) -> tuple[int, int, int]:
    """(slices per thread, min blocks per SM, threads per block) of the v3 kernel."""
    slices = hidden // 8
    if slices <= 320:
        return 1, 2, max(32, -(-slices // 32) * 32)
    if slices <= 512:
        return 1, 1, -(-slices // 32) * 32
    if slices <= 1024:
        return 2, 1, -(-(-(-slices // 2)) // 32) * 32
    raise ValueError(f"hidden size H must be at most {MAX_HIDDEN}, got {hidden}")


def v3_shared_bytes(streams: int, per_thread: int, threads: int) -> int:
    """Dynamic shared memory of v3: the block's S accumulator [N][slices per thread][8][threads]."""
    return streams * per_thread * 8 * threads * 4


def v4_threads(hidden: int) -> int:
    """Threads per v4 block: one compute thread per 8-element slice, rounded up to whole warps,
    plus the scalar warp."""
    return -(-(hidden // 8) // 32) * 32 + 32


def v4_shared_bytes(streams: int, hidden: int, stages: int) -> int:
    """Dynamic shared memory of v4: `stages` stages of 2N+1 bf16 rows, then R*w in fp32 [N, H]."""
    return stages * (2 * streams + 1) * 2 * hidden + streams * hidden * 4


def _v4_fits(streams: int, hidden: int, stages: int, static_bytes: int) -> bool:
    return (v4_threads(hidden) <= V4_MAX_THREADS
            and v4_shared_bytes(streams, hidden, stages) + static_bytes <= SHARED_PER_BLOCK)


def v4_supported(streams: int, hidden: int) -> bool:
    """Whether v4's ring of V4_MIN_STAGES stages fits one block (and one slice per thread does)."""
    return _v4_fits(streams, hidden, V4_MIN_STAGES, V4_STATIC_SHARED_BOUND)


def v4_launch_plan(streams: int, hidden: int, static_bytes: int = V4_STATIC_SHARED_BOUND,
                   stages: int | None = None) -> int:
    """Ring stages of v4: the most (at most V4_MAX_STAGES) that fit one block's shared memory, or
    `stages` if the caller fixes it (v4_plan_override); a choice that does not fit raises ValueError."""
    if not v4_supported(streams, hidden):
        raise ValueError(f"v4 does not apply to N = {streams}, H = {hidden}: its shared-memory ring "
                         f"does not fit (H <= 2560 needed); use version 3")
    for count in ((stages,) if stages else range(V4_MAX_STAGES, V4_MIN_STAGES - 1, -1)):
        if V4_MIN_STAGES <= count <= V4_MAX_STAGES and _v4_fits(streams, hidden, count, static_bytes):
            return count
    raise ValueError(f"v4 with {stages} stages does not fit N = {streams}, H = {hidden}")


def v4_stage_choices(streams: int, hidden: int) -> list[int]:
    """Every ring-stage count v4 can launch with for this N and H (the sweep and the tests)."""
    if not v4_supported(streams, hidden):
        return []
    return [count for count in range(V4_MIN_STAGES, V4_MAX_STAGES + 1)
            if _v4_fits(streams, hidden, count, V4_STATIC_SHARED_BOUND)]


# Ring stages that v4 launches with instead of v4_launch_plan's choice (None: the default). Set
# only through v4_plan_override.
_v4_stages_override: int | None = None


@contextlib.contextmanager
def v4_plan_override(stages: int | None = None) -> Iterator[None]:
    """Launch v4 with this many ring stages inside the block (the tuning sweep and the tests that
    cover every plan); a count that does not fit the shape raises ValueError at the call."""
    global _v4_stages_override
    saved, _v4_stages_override = _v4_stages_override, stages
    try:
        yield
    finally:
        _v4_stages_override = saved


def _validate(grad_corrected, hidden_states, activated, prediction_coefs, correction_coefs,
              router_weight, norm_weight, active_idx, eps):
    g = _arrays.accept("grad_corrected", grad_corrected, BF16, (None, None, None, None), vector_rows=True)
    streams, batch, seq, hidden = g.shape
    if streams not in SUPPORTED_STREAMS:
        raise ValueError(f"grad_corrected must hold N in {SUPPORTED_STREAMS} streams (dim 0), got {streams}")
    if hidden % 8:
        raise ValueError(f"hidden size H (grad_corrected dim 3) must be divisible by 8, got {hidden}")
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size H (grad_corrected dim 3) must be at most {MAX_HIDDEN}, got {hidden}")
    hs = _arrays.accept("hidden_states", hidden_states, BF16, (streams, batch, seq, hidden), vector_rows=True)
    act = _arrays.accept("activated", activated, BF16, (batch, seq, hidden), vector_rows=True)
    P = _arrays.accept("prediction_coefs", prediction_coefs, BF16, (streams * streams, streams))
    Q = _arrays.accept("correction_coefs", correction_coefs, BF16, (streams, streams))
    R = _arrays.accept("router_weight", router_weight, BF16, (streams, hidden), vector_rows=True)
    w = _arrays.accept("norm_weight", norm_weight, BF16, (hidden,), vector_rows=True)
    a = _arrays.index_in_range("active_idx", active_idx, streams)
    eps = _arrays.positive_finite("eps", eps)
    args = (g, hs, act, P, Q, R, w)
    framework, device = _arrays.same_device(args)
    return args, a, eps, framework, device


def predict_correct_backward(grad_corrected: Any, hidden_states: Any, activated: Any,
                             prediction_coefs: Any, correction_coefs: Any, router_weight: Any,
                             norm_weight: Any, active_idx: int = 0, eps: float = 1e-6, *,
                             version: int | None = DEFAULT_VERSION) -> PredictCorrectGrads:
    """The six gradients of AltUp's predict + correct step (docs/SPEC.md section 2).

    grad_corrected, hidden_states: bf16 [N, B, S, H]; activated: bf16 [B, S, H];
    prediction_coefs bf16 [N*N, N]; correction_coefs bf16 [N, N]; router_weight bf16 [N, H];
    norm_weight bf16 [H]; N in {2, 3, 4}, H divisible by 8 and at most 8192.
    Returns `PredictCorrectGrads` of the caller's array type: bf16 activation gradients and fp32
    weight gradients, computed on the caller's current stream. Inputs are not modified.
    version None (default): 4 where it applies (H <= 2560), else 3. Version 4: fused single pass
    with the rows streamed through a shared-memory ring by the bulk-copy engine; 3: fused single
    pass, one block reduction per token; 2: fused, three reduction rounds per token; 1:
    step-by-step kernels.
    """
    if version is not None and version not in VERSIONS:
        raise ValueError(f"version must be None or one of {VERSIONS}, got {version!r}")
    args, a, eps, framework, device = _validate(grad_corrected, hidden_states, activated,
                                                prediction_coefs, correction_coefs, router_weight,
                                                norm_weight, active_idx, eps)
    g = args[0]
    streams, batch, seq, hidden = g.shape
    if version is None:
        version = 4 if v4_supported(streams, hidden) else 3
    elif version == 4:
        v4_launch_plan(streams, hidden)  # a clear error where v4 does not apply
    tokens = batch * seq
    grad_hs = _arrays.empty(framework, g, (streams, batch, seq, hidden), BF16)
    grad_act = _arrays.empty(framework, g, (batch, seq, hidden), BF16)
    if tokens == 0:
        zeros = lambda shape: _arrays.zeros(framework, g, shape, F32)  # noqa: E731
        return PredictCorrectGrads(grad_hs.array, grad_act.array, zeros((streams * streams, streams)),
                                   zeros((streams, streams)), zeros((streams, hidden)), zeros((hidden,)))
    with _arrays.caller_stream(framework, device) as stream:
        grad_P = _arrays.empty(framework, g, (streams * streams, streams), F32)
        grad_Q = _arrays.empty(framework, g, (streams, streams), F32)
        grad_R = _arrays.empty(framework, g, (streams, hidden), F32)
        grad_w = _arrays.empty(framework, g, (hidden,), F32)
        outs = (grad_hs, grad_act, grad_P, grad_Q, grad_R, grad_w)
        if version == 4:
            _launch_v4(args, outs, a, eps, framework, device, stream)
        elif version == 3:
            _launch_v3(args, outs, a, eps, framework, device, stream)
        elif version == 2:
            _launch_v2(args, outs, a, eps, framework, device, stream)
        else:
            _launch_v1(args, outs, a, eps, framework, stream)
    return PredictCorrectGrads(*(o.array for o in outs))


def _ptr(arg) -> numpy.uint64:
    return numpy.uint64(arg.ptr)


def _reduce(partials, blocks: int, streams: int, hidden: int, outs, stream) -> None:
    _, _, grad_P, grad_Q, grad_R, grad_w = outs
    columns = partial_stride(streams, hidden) // 4  # float4 columns, 32 per block
    SOURCE.kernel(f"pc_reduce_partials<{streams}>")(
        (-(-columns // 32),), (1024,),
        (_ptr(partials), numpy.int32(blocks), numpy.int32(hidden), _ptr(grad_R), _ptr(grad_w),
         _ptr(grad_P), _ptr(grad_Q)),
        stream=stream,
    )


def _launch_v2(args, outs, a, eps, framework, device, stream) -> None:
    g, hs, act, P, Q, R, w = args
    grad_hs, grad_act = outs[0], outs[1]
    streams, batch, seq, hidden = g.shape
    tokens = batch * seq
    per_thread, resident, threads = v2_launch_shape(streams, hidden)
    kernel = SOURCE.kernel(f"pc_v2_fused<{streams}, {a}, {per_thread}, {'true' if resident else 'false'}>")
    shared = v2_shared_bytes(streams, per_thread, resident, threads)
    blocks = min(tokens, _sm_count(device) * _occupancy(kernel, threads, shared, cap=2))
    partials = _arrays.empty(framework, g, (blocks * partial_stride(streams, hidden),), F32)
    kernel(
        (blocks,), (threads,),
        (_ptr(g), _ptr(hs), _ptr(act), _ptr(P), _ptr(Q), _ptr(R), _ptr(w), _ptr(grad_hs),
         _ptr(grad_act), _ptr(partials), numpy.int32(hidden), numpy.int64(tokens), numpy.float32(eps)),
        stream=stream, shared_mem=shared,
    )
    _reduce(partials, blocks, streams, hidden, outs, stream)


def _launch_v3(args, outs, a, eps, framework, device, stream) -> None:
    g, hs, act, P, Q, R, w = args
    grad_hs, grad_act = outs[0], outs[1]
    streams, batch, seq, hidden = g.shape
    tokens = batch * seq
    per_thread, min_blocks, threads = v3_launch_shape(hidden)
    kernel = SOURCE.kernel(f"pc_v3_fused<{streams}, {a}, {per_thread}, {min_blocks}>")
    shared = v3_shared_bytes(streams, per_thread, threads)
    blocks = min(tokens, _sm_count(device) * _occupancy(kernel, threads, shared, cap=8))
    partials = _arrays.empty(framework, g, (blocks * partial_stride(streams, hidden),), F32)
    kernel(
        (blocks,), (threads,),
        (_ptr(g), _ptr(hs), _ptr(act), _ptr(P), _ptr(Q), _ptr(R), _ptr(w), _ptr(grad_hs),
         _ptr(grad_act), _ptr(partials), numpy.int32(hidden), numpy.int64(tokens), numpy.float32(eps)),
        stream=stream, shared_mem=shared,
    )
    _reduce(partials, blocks, streams, hidden, outs, stream)


def _launch_v4(args, outs, a, eps, framework, device, stream) -> None:
    g, hs, act, P, Q, R, w = args
    grad_hs, grad_act = outs[0], outs[1]
    streams, batch, seq, hidden = g.shape
    tokens = batch * seq
    kernel = SOURCE.kernel(f"pc_v4_fused<{streams}, {a}>")
    stages = v4_launch_plan(streams, hidden, kernel.shared_size_bytes, _v4_stages_override)
    shared = v4_shared_bytes(streams, hidden, stages)
    threads = v4_threads(hidden)
    blocks = min(tokens, _sm_count(device) * _occupancy(kernel, threads, shared, cap=1, carveout_shared=True))
    partials = _arrays.empty(framework, g, (blocks * partial_stride(streams, hidden),), F32)
    kernel(
        (blocks,), (threads,),
        (_ptr(g), _ptr(hs), _ptr(act), _ptr(P), _ptr(Q), _ptr(R), _ptr(w), _ptr(grad_hs),
         _ptr(grad_act), _ptr(partials), numpy.int32(hidden), numpy.int64(tokens), numpy.float32(eps),
         numpy.int32(stages)),
        stream=stream, shared_mem=shared,
    )
    _reduce(partials, blocks, streams, hidden, outs, stream)


def _launch_v1(args, outs, a, eps, framework, stream) -> None:
    g, hs, act, P, Q, R, w = args
    grad_hs, grad_act = outs[0], outs[1]
    streams, batch, seq, hidden = g.shape
    tokens = batch * seq
    slices = hidden // 8
    n, M, H, A = streams, numpy.int64(tokens), numpy.int32(hidden), numpy.int32(a)
    k = lambda stage: SOURCE.kernel(f"pc_v1_{stage}<{n}>")  # noqa: E731
    stats = _arrays.empty(framework, g, (tokens * token_stats_size(n),), F32)
    gx_p = _arrays.empty(framework, g, (tokens * hidden,), F32)
    gx_c = _arrays.empty(framework, g, (tokens * hidden,), F32)
    per_token = ((tokens,), (V1_THREADS,))
    # 1. forward statistics and router outputs
    k("forward_stats")(*per_token, (_ptr(hs), _ptr(act), _ptr(P), _ptr(Q), _ptr(R), _ptr(w),
                                    _ptr(stats), H, M, A, numpy.float32(eps)), stream=stream)
    # 2. correction-coefficient gradients
    k("correction_grads")(*per_token, (_ptr(g), _ptr(hs), _ptr(act), _ptr(stats), H, M, A), stream=stream)
    # 3. correct-step router backward
    k("correct_router_bwd")(*per_token, (_ptr(act), _ptr(Q), _ptr(R), _ptr(w), _ptr(stats), _ptr(gx_c),
                                         H, M), stream=stream)
    # 4. prediction-coefficient gradients
    k("prediction_grads")(*per_token, (_ptr(g), _ptr(hs), _ptr(stats), H, M, A), stream=stream)
    # 5. predict-step router backward
    k("predict_router_bwd")(*per_token, (_ptr(hs), _ptr(P), _ptr(R), _ptr(w), _ptr(stats), _ptr(gx_p),
                                         H, M, A), stream=stream)
    # 6. element-wise gradients
    k("elementwise")((-(-(tokens * slices) // V1_THREADS),), (V1_THREADS,),
                     (_ptr(g), _ptr(stats), _ptr(gx_p), _ptr(gx_c), _ptr(grad_hs), _ptr(grad_act), H, M, A),
                     stream=stream)
    # 7. weight-gradient reductions: per-chunk partials, then the shared fixed-order reduction
    chunks = min(tokens, V1_MAX_CHUNKS)
    per_chunk = -(-tokens // chunks)
    chunks = -(-tokens // per_chunk)
    partials = _arrays.empty(framework, g, (chunks * partial_stride(n, hidden),), F32)
    k("weight_grads")((-(-slices // V1_THREADS), chunks), (V1_THREADS,),
                      (_ptr(hs), _ptr(act), _ptr(R), _ptr(w), _ptr(stats), _ptr(partials), H, M, A,
                       numpy.int64(per_chunk)), stream=stream)
    k("coef_grads")((n**3 + n**2, chunks), (V1_THREADS,),
                    (_ptr(stats), _ptr(partials), H, M, numpy.int64(per_chunk)), stream=stream)
    _reduce(partials, chunks, n, hidden, outs, stream)
