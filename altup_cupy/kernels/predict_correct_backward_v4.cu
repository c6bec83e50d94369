// predict_correct_backward_v4.cu: the backward of AltUp's predict + correct step (docs/SPEC.md
// section 2), v3's arithmetic fed by Hopper's bulk-copy engine (sm_90 only); notation of
// predict_correct_backward_v1.cu. The block body is ring_backward.cuh's.
//
// What this version changed:
//   v4: v3's arithmetic with the rows streamed into a ring of shared-memory stages by the bulk-copy
//       engine (cp.async.bulk + mbarrier), two tokens ahead, and the scalar phase on a dedicated
//       warp one token behind the compute warps: one barrier per token, no warp idle behind warp 0.
#include "ring_backward.cuh"

// Per-compute-warp sums: 17 columns hold the <= 10 compute warps of H <= 2560 (odd: no bank conflicts).
constexpr int kV4SumColumns = 17;

static_assert(ring_static_shared_bytes<4, kV4SumColumns>() <= ALTUP_V4_STATIC_SHARED_BOUND, "_sources.V4_STATIC_SHARED_BOUND");

// Block: one compute thread per 8-element slice, rounded up to whole warps, plus the scalar warp:
// at most 11 warps (H <= 2560), so three warps share a scheduler's 16K registers and each thread
// may hold 128 (at 17 warps, for H = 4096, the cap would be 96 and S would spill): ALTUP_V4_MAX_THREADS.
template <int N, int A>
__global__ void __launch_bounds__(ALTUP_V4_MAX_THREADS, 1) predict_correct_backward_v4(SINGLE_PASS_BACKWARD_PARAMETERS,
                                                                                       const int stages) {
    ring_block_backward<N, A, kVec, kV4SumColumns>(grad, hs, act, P, Q, router, norm, grad_hs, grad_act, partials,
                                                    hidden, tokens, eps, stages);
}
