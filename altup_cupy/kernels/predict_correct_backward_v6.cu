// predict_correct_backward_v6.cu: the backward of AltUp's predict + correct step (docs/SPEC.md
// section 2), v4 with twice the compute warps (sm_90 only); notation of
// predict_correct_backward_v1.cu. The block body is ring_backward.cuh's.
//
// What this version changed:
//   v6: v4 with half slices: a compute thread owns 4 elements of each row (one 8-byte word) instead
//       of 8, so a block has twice the compute warps to hide latency, each holding half the rows
//       and half of S in registers.
#include "ring_backward.cuh"

// v4 at M = 8192 (results/nvidia-h200/ncu_717ada5_M8192.txt): 2.5 warps per scheduler, 0.83 of
// them eligible per cycle, one instruction issued every 2.3 cycles, DRAM 54% busy: too few warps
// to cover the latency of the shared-memory reads, the shuffles and the FMA chains. Half slices
// double the warps (H = 2304: 18 compute warps instead of 9) at the price of twice the warp
// reductions per token (each warp still sums the token's 2 + 3N + N^2 values).
constexpr int kHalfSlice = 4;

// Per-compute-warp sums: 21 columns hold the <= 19 compute warps of H <= 2432 (odd: no bank conflicts).
constexpr int kV6SumColumns = 21;

static_assert(ring_static_shared_bytes<3, kV6SumColumns>() <= ALTUP_V6_STATIC_SHARED_BOUND, "_sources.V6_STATIC_SHARED_BOUND");

// Block: one compute thread per half slice, rounded up to whole warps, plus the scalar warp: at most
// 20 warps (H <= 2432). Registers are allocated per scheduler (16K each, 4 a SM): 5 warps a
// scheduler may hold 102 registers a thread, so ptxas caps them at 96 (at 21 warps, 6 on one
// scheduler, the cap would be 80 and S would spill): ALTUP_V6_MAX_THREADS.
template <int N, int A>
__global__ void __launch_bounds__(ALTUP_V6_MAX_THREADS, 1) predict_correct_backward_v6(SINGLE_PASS_BACKWARD_PARAMETERS,
                                                                                       const int stages) {
    ring_block_backward<N, A, kHalfSlice, kV6SumColumns>(grad, hs, act, P, Q, router, norm, grad_hs, grad_act,
                                                          partials, hidden, tokens, eps, stages);
}
