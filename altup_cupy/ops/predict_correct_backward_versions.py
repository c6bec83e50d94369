"""The predict-correct backward's kernel versions and their launch plans (docs/SPEC.md section 2).

v6 (Hopper): v4 with half slices: a compute thread owns 4 elements of each row instead of 8, so a
    block has twice the warps to hide latency (N <= 3, H <= 2432).
v4 (Hopper): v3's arithmetic with each token's rows streamed into a ring of shared-memory stages
    by the bulk-copy engine (cp.async.bulk completing on an mbarrier), two tokens ahead of the
    compute, and the per-token scalar phase on a dedicated warp one token behind; one block per SM.
v3: one pass over memory on a persistent grid with ONE block reduction per token.
v2: the first fused version: three reduction rounds per token.
v1 (teaching): one small kernel per derivation stage, intermediates in global scratch.
v2-v4 and v6 write per-block partials of the weight gradients that the reduce kernel sums in a
fixed order (bitwise deterministic); v1 writes per-chunk partials that the same kernel sums.

A plan is built once per (version, N, active index, tokens, H, device; v4 and v6 also per ring-stage
count): launch shape, occupancy, packed launches. It is called as every plan is (`_registry`):
inputs the op's seven tensors, outputs its six gradients; a call takes the weight-gradient partials
from scratch memory (`_scratch`: reused per stream on the eager fast path, else fresh) and
launches.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import _device
from .. import _sources as S
from .._build import KernelSource
from .._launch import PackedLaunch, ceil_div, round_up
from .._occupancy import SM_LIMITS, blocks_per_sm
from .._scratch import StreamScratch
from ._registry import Version

# Hopper's shared memory: at most 227 KiB per block.
SHARED_PER_BLOCK = 227 * 1024
# The widest rows v2 (4 slices of 8 x 256 threads) and v3 (2 slices of 8 x 512 threads) cover.
MAX_HIDDEN = 8192
V1_MAX_CHUNKS = 256  # token chunks of v1's weight-gradient reductions
RING_MIN_STAGES = 3  # token j in pass 1, token j - 1 in pass 2, and one arriving
MAIN_ARGS = ("ptr",) * 10 + ("i32", "i64", "f32")  # g hs act P Q R w grad_hs grad_act partials H M eps
# Every fused version's per-block weight-gradient partials.
_PARTIALS = StreamScratch()


def _grid(kernel, threads: int, shared: int, cap: int, tokens: int, device: int,
          carveout_shared: bool = False) -> int:
    """Persistent grid size; lets the kernel use `shared` bytes of dynamic shared memory (past
    48 KiB, static included, a kernel must opt in). carveout_shared: ask for the largest
    shared-memory carveout of L1 (for a kernel that reads through shared memory, not L1)."""
    if kernel.max_dynamic_shared_size_bytes < shared:
        kernel.max_dynamic_shared_size_bytes = shared
    if carveout_shared:
        kernel.preferred_shared_memory_carveout = 100
    # Hopper's limits whatever the GPU: the limits these grids were measured with (results/nvidia-h200/).
    resident, _ = blocks_per_sm(SM_LIMITS["sm_90"], kernel.num_regs, threads, shared + kernel.shared_size_bytes)
    per_sm = max(1, min(resident, cap))
    return min(tokens, _device.sm_count(device) * per_sm)


class _Reduce:
    """The fixed-order sum of `blocks` partial rows into the four fp32 weight gradients; on Hopper a
    programmatic dependent launch that waits in the kernel for the partials (_launch)."""

    def __init__(self, streams: int, hidden: int):
        kernel = S.PREDICT_CORRECT_BACKWARD_REDUCE.kernel(f"predict_correct_backward_reduce<{streams}>")
        self.launch = PackedLaunch(kernel, S.REDUCE_THREADS, 0, ("ptr", "i32", "i32", "ptr", "ptr", "ptr", "ptr"),
                                   programmatic=True)
        self.grid = S.reduce_blocks(streams, hidden)
        self.hidden = hidden

    def __call__(self, stream: int, partials: int, blocks: int, outs) -> None:
        _, _, grad_P, grad_Q, grad_R, grad_w = outs
        self.launch(stream, self.grid, partials, blocks, self.hidden, grad_R.data_ptr(),
                    grad_w.data_ptr(), grad_P.data_ptr(), grad_Q.data_ptr())


class FusedPlan:
    """v2-v4: one persistent kernel writing activation gradients and per-block partials, then the
    reduction."""

    def __init__(self, kernel, threads: int, shared: int, blocks: int, streams: int, tokens: int,
                 hidden: int, extra_args: tuple = (), extra_types: tuple = ()):
        self.main = PackedLaunch(kernel, threads, shared, MAIN_ARGS + extra_types)
        self.reduce = _Reduce(streams, hidden)
        self.blocks, self.extra_args = blocks, extra_args
        self.partial_floats = blocks * S.partial_stride(streams, hidden)
        self.tokens, self.hidden = tokens, hidden

    def __call__(self, inputs, outs, scalars: tuple[float], stream: int, reuse_scratch: bool) -> None:
        eps, = scalars
        # Held until both launches are queued: a buffer freed before its launch could be handed
        # to the next allocation of this call.
        partials, key = _PARTIALS.take(4 * self.partial_floats, outs[0].device, stream, reuse_scratch)
        self.main(stream, self.blocks, *(t.data_ptr() for t in inputs), outs[0].data_ptr(), outs[1].data_ptr(),
                  partials.data_ptr(), self.hidden, self.tokens, eps, *self.extra_args)
        self.reduce(stream, partials.data_ptr(), self.blocks, outs)
        _PARTIALS.give_back(partials, key)


# ---- v1 -----------------------------------------------------------------------------------------


class V1Plan:
    """One kernel per derivation stage; scratch rows in fp32."""

    def __init__(self, streams: int, active: int, tokens: int, hidden: int):
        n = streams
        kernel = lambda stage: S.PREDICT_CORRECT_BACKWARD_V1.kernel(  # noqa: E731
            f"predict_correct_backward_v1_{stage}<{n}>")
        t = S.V1_THREADS
        P = lambda count: ("ptr",) * count  # noqa: E731
        self.forward_stats = PackedLaunch(kernel("forward_stats"), t, 0, P(7) + ("i32", "i64", "i32", "f32"))
        self.correction_grads = PackedLaunch(kernel("correction_grads"), t, 0, P(4) + ("i32", "i64", "i32"))
        self.correct_router_bwd = PackedLaunch(kernel("correct_router_bwd"), t, 0, P(6) + ("i32", "i64"))
        self.prediction_grads = PackedLaunch(kernel("prediction_grads"), t, 0, P(3) + ("i32", "i64", "i32"))
        self.predict_router_bwd = PackedLaunch(kernel("predict_router_bwd"), t, 0, P(6) + ("i32", "i64", "i32"))
        self.elementwise = PackedLaunch(kernel("elementwise"), t, 0, P(6) + ("i32", "i64", "i32"))
        self.weight_grads = PackedLaunch(kernel("weight_grads"), t, 0, P(6) + ("i32", "i64", "i32", "i64"))
        self.coef_grads = PackedLaunch(kernel("coef_grads"), t, 0, P(2) + ("i32", "i64", "i64"))
        self.reduce = _Reduce(streams, hidden)
        chunks = min(tokens, V1_MAX_CHUNKS)
        self.per_chunk = ceil_div(tokens, chunks)
        self.chunks = ceil_div(tokens, self.per_chunk)
        self.streams, self.active, self.tokens, self.hidden = streams, active, tokens, hidden

    def __call__(self, inputs, outs, scalars: tuple[float], stream: int, reuse_scratch: bool) -> None:
        eps, = scalars
        n, a, M, H = self.streams, self.active, self.tokens, self.hidden
        g, hs, act, P, Q, R, w = (t.data_ptr() for t in inputs)
        grad_hs, grad_act = outs[0].data_ptr(), outs[1].data_ptr()
        f32 = dict(dtype=torch.float32, device=outs[0].device)
        stats = torch.empty(M * S.token_stats_size(n), **f32)
        gx_p, gx_c = torch.empty(M * H, **f32), torch.empty(M * H, **f32)
        partials = torch.empty(self.chunks * S.partial_stride(n, H), **f32)
        st, xp, xc, pa = stats.data_ptr(), gx_p.data_ptr(), gx_c.data_ptr(), partials.data_ptr()
        slices = H // 8
        self.forward_stats(stream, M, hs, act, P, Q, R, w, st, H, M, a, eps)
        self.correction_grads(stream, M, g, hs, act, st, H, M, a)
        self.correct_router_bwd(stream, M, act, Q, R, w, st, xc, H, M)
        self.prediction_grads(stream, M, g, hs, st, H, M, a)
        self.predict_router_bwd(stream, M, hs, P, R, w, st, xp, H, M, a)
        self.elementwise(stream, ceil_div(M * slices, S.V1_THREADS), g, st, xp, xc, grad_hs, grad_act, H, M, a)
        self.weight_grads(stream, (ceil_div(slices, S.V1_THREADS), self.chunks), hs, act, R, w, st, pa,
                          H, M, a, self.per_chunk)
        self.coef_grads(stream, (n**3 + n**2, self.chunks), st, pa, H, M, self.per_chunk)
        self.reduce(stream, pa, self.chunks, outs)


# ---- v2 -----------------------------------------------------------------------------------------


def v2_launch_shape(streams: int, hidden: int) -> tuple[int, bool, int]:
    """(slices per thread, resident, threads per block) of v2 for this N and H. v2 gives thread i
    the coefficient-gradient entry i, so a block has at least N^3 + N^2 threads."""
    slices = hidden // 8
    min_threads = round_up(streams**3 + streams**2, 32)
    if slices <= S.V2_RESIDENT_THREADS[streams]:
        return 1, True, max(min_threads, round_up(slices, 32))
    for per_thread in S.NONRESIDENT_SLICES:
        threads = ceil_div(slices, per_thread)
        if threads <= S.V2_NONRESIDENT_THREADS:
            return per_thread, False, max(min_threads, round_up(threads, 32))
    raise ValueError(f"hidden size H must be at most {MAX_HIDDEN}, got {hidden}")


def v2_shared_bytes(streams: int, per_thread: int, resident: bool, threads: int) -> int:
    """Dynamic shared memory: fp32 accumulators, then (resident) the cp.async prefetch stage."""
    acc = (streams + 1) * per_thread * 8 * threads * 4
    stage = (2 * streams + 1) * per_thread * threads * 16 if resident else 0
    return acc + 2 * stage


def _v2_plan(streams: int, active: int, tokens: int, hidden: int, device: int) -> FusedPlan:
    per_thread, resident, threads = v2_launch_shape(streams, hidden)
    kernel = S.PREDICT_CORRECT_BACKWARD_V2.kernel(
        f"predict_correct_backward_v2<{streams}, {active}, {per_thread}, {'true' if resident else 'false'}>")
    shared = v2_shared_bytes(streams, per_thread, resident, threads)
    blocks = _grid(kernel, threads, shared, 2, tokens, device)
    return FusedPlan(kernel, threads, shared, blocks, streams, tokens, hidden)


# ---- v3 -----------------------------------------------------------------------------------------


def v3_launch_shape(streams: int, hidden: int) -> tuple[int, int, int]:
    """(slices per thread, min blocks per SM, threads per block) of v3: two blocks per SM while
    one slice per thread covers H in the two-block launch bound, then one, then two slices."""
    slices = hidden // 8
    for per_thread, min_blocks in S.v3_variants(streams):
        threads = round_up(ceil_div(slices, per_thread), 32)
        if threads <= (S.V3_TWO_BLOCK_THREADS if min_blocks == 2 else S.V3_ONE_BLOCK_THREADS):
            return per_thread, min_blocks, threads
    raise ValueError(f"hidden size H must be at most {MAX_HIDDEN}, got {hidden}")


def v3_shared_bytes(streams: int, per_thread: int, threads: int) -> int:
    """Dynamic shared memory of v3: the block's S accumulator [N][slices per thread][8][threads]."""
    return streams * per_thread * 8 * threads * 4


def _v3_plan(streams: int, active: int, tokens: int, hidden: int, device: int) -> FusedPlan:
    per_thread, min_blocks, threads = v3_launch_shape(streams, hidden)
    kernel = S.PREDICT_CORRECT_BACKWARD_V3.kernel(
        f"predict_correct_backward_v3<{streams}, {active}, {per_thread}, {min_blocks}>")
    shared = v3_shared_bytes(streams, per_thread, threads)
    blocks = _grid(kernel, threads, shared, 8, tokens, device)
    return FusedPlan(kernel, threads, shared, blocks, streams, tokens, hidden)


# ---- the ring kernels: v4, v6 ------------------------------------------------------------------


@dataclass(frozen=True, eq=False)  # each instance its own key (ring_plan's cache)
class RingKernel:
    """One ring kernel (kernels/ring_backward.cuh): its source, how many elements of a row one
    compute thread owns, its launch bound, the bound on its static shared memory, the N it is
    built for and what serves the shapes it cannot (in words, for the error)."""

    source: KernelSource
    elements: int
    max_threads: int
    static_shared_bound: int
    streams: tuple[int, ...]
    instead: str

    def kernel_name(self, streams: int, active: int) -> str:
        return f"{self.source.filename.removesuffix('.cu')}<{streams}, {active}>"


V4_RING = RingKernel(S.PREDICT_CORRECT_BACKWARD_V4, 8, S.V4_MAX_THREADS, S.V4_STATIC_SHARED_BOUND,
                     S.SUPPORTED_STREAMS, "version 3")
V6_RING = RingKernel(S.PREDICT_CORRECT_BACKWARD_V6, 4, S.V6_MAX_THREADS, S.V6_STATIC_SHARED_BOUND, S.V6_STREAMS,
                     "version 4 (H <= 2560) or 3")
RINGS = {4: V4_RING, 6: V6_RING}  # version number -> ring kernel (the sweep and the tests run each)


def ring_threads(ring: RingKernel, hidden: int) -> int:
    """Threads per block: one compute thread per `ring.elements` elements of a row, rounded up to
    whole warps, plus the scalar warp."""
    return round_up(hidden // ring.elements, 32) + 32


def ring_shared_bytes(streams: int, hidden: int, stages: int) -> int:
    """Dynamic shared memory of a ring kernel: `stages` stages of 2N+1 bf16 rows, then R*w in fp32 [N, H]."""
    return stages * (2 * streams + 1) * 2 * hidden + streams * hidden * 4


def _ring_fits(ring: RingKernel, streams: int, hidden: int, stages: int, static_bytes: int) -> bool:
    return (streams in ring.streams and ring_threads(ring, hidden) <= ring.max_threads
            and ring_shared_bytes(streams, hidden, stages) + static_bytes <= SHARED_PER_BLOCK)


def ring_supported(ring: RingKernel, streams: int, hidden: int) -> bool:
    """Whether the ring of its fewest stages fits one block (and one slice per thread does)."""
    return _ring_fits(ring, streams, hidden, RING_MIN_STAGES, ring.static_shared_bound)


def ring_stage_choices(ring: RingKernel, streams: int, hidden: int) -> list[int]:
    """Every ring-stage count the kernel can launch with for this N and H (the sweep and the tests)."""
    if not ring_supported(ring, streams, hidden):
        return []
    return [count for count in range(RING_MIN_STAGES, S.RING_MAX_STAGES + 1)
            if _ring_fits(ring, streams, hidden, count, ring.static_shared_bound)]


def ring_launch_plan(ring: RingKernel, streams: int, hidden: int, static_bytes: int | None = None,
                     stages: int | None = None) -> int:
    """Ring stages: the most that fit one block's shared memory, or `stages` if fixed (ring_plan's
    `stages`); a choice that does not fit raises ValueError."""
    static_bytes = ring.static_shared_bound if static_bytes is None else static_bytes
    if not ring_supported(ring, streams, hidden):
        largest = (ring.max_threads - 32) * ring.elements
        raise ValueError(f"{ring.source.filename} does not apply to N = {streams}, H = {hidden}: it is built for "
                         f"N in {ring.streams} and H <= {largest} with a shared-memory ring that fits one block; "
                         f"use {ring.instead}")
    for count in ((stages,) if stages else range(S.RING_MAX_STAGES, RING_MIN_STAGES - 1, -1)):
        if RING_MIN_STAGES <= count <= S.RING_MAX_STAGES and _ring_fits(ring, streams, hidden, count, static_bytes):
            return count
    raise ValueError(f"{ring.source.filename} with {stages} stages does not fit N = {streams}, H = {hidden}")


@functools.lru_cache(maxsize=256)
def ring_plan(ring: RingKernel, streams: int, active: int, tokens: int, hidden: int, device: int,
              stages: int | None = None) -> FusedPlan:
    """A ring kernel's plan of one shape: `stages` ring stages (the tuning sweep, the tests of every
    stage count; a count that does not fit raises ValueError), or None: the most that fit one block."""
    with torch.cuda.device(device):
        kernel = ring.source.kernel(ring.kernel_name(streams, active))
        stages = ring_launch_plan(ring, streams, hidden, kernel.shared_size_bytes, stages)
        shared = ring_shared_bytes(streams, hidden, stages)
        threads = ring_threads(ring, hidden)
        blocks = _grid(kernel, threads, shared, 1, tokens, device, carveout_shared=True)
        return FusedPlan(kernel, threads, shared, blocks, streams, tokens, hidden, (stages,), ("i32",))


# v4 and v6 as the registry, the sweep and the tests call them.
v4_supported = functools.partial(ring_supported, V4_RING)
v4_launch_plan = functools.partial(ring_launch_plan, V4_RING)
v4_plan = functools.partial(ring_plan, V4_RING)
v6_supported = functools.partial(ring_supported, V6_RING)
v6_plan = functools.partial(ring_plan, V6_RING)


def _cached(build):
    @functools.lru_cache(maxsize=256)
    def plan(streams: int, active: int, tokens: int, hidden: int, device: int):
        with torch.cuda.device(device):
            return build(streams, active, tokens, hidden, device)
    return plan


VERSIONS = {
    1: Version(1, "one small kernel per derivation stage, intermediates in global scratch",
               (S.PREDICT_CORRECT_BACKWARD_V1, S.PREDICT_CORRECT_BACKWARD_REDUCE),
               lambda streams, hidden: True,
               _cached(lambda n, a, m, h, d: V1Plan(n, a, m, h)),
               kept_because="teaching step: one kernel per derivation stage, the readable baseline"),
    2: Version(2, "one fused pass, three block-reduction rounds per token",
               (S.PREDICT_CORRECT_BACKWARD_V2, S.PREDICT_CORRECT_BACKWARD_REDUCE),
               lambda streams, hidden: True, _cached(_v2_plan),
               kept_because="teaching step: the first fused kernel, before the reductions were merged"),
    3: Version(3, "one block reduction per token (every reduction is a dot product of raw rows)",
               (S.PREDICT_CORRECT_BACKWARD_V3, S.PREDICT_CORRECT_BACKWARD_REDUCE),
               lambda streams, hidden: True, _cached(_v3_plan),
               kept_because="the portable default: v4 needs sm_90 and H <= 2560; v3 serves every other GPU "
                            "(sm_80 on) and shape"),
    4: Version(4, "rows streamed into a shared-memory ring by the bulk-copy engine; scalar warp",
               (S.PREDICT_CORRECT_BACKWARD_V4, S.PREDICT_CORRECT_BACKWARD_REDUCE),
               v4_supported, v4_plan),
    6: Version(6, "v4 with half slices: 4 elements a compute thread, twice the warps (N <= 3, H <= 2432)",
               (S.PREDICT_CORRECT_BACKWARD_V6, S.PREDICT_CORRECT_BACKWARD_REDUCE),
               v6_supported, v6_plan),
}
# The default: the first of these that runs on the device and shape (v4 needs Hopper). v6 is new:
# it joins once a recorded benchmark run shows it faster than v4.
PREFERENCE = (4, 3)
