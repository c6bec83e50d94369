// altup_correct_backward_v4.cu: the correct step's backward (altup_correct_backward.cuh), version 4.
//
// What this version changed: v2 (slice-major sums, UnpackedRows) capped at 80 registers a thread,
// so that three blocks share an SM instead of two (ROUTED_BACKWARD_BOUNDS_THREE_BLOCKS,
// altup_rows.cuh): more loads in flight while a block waits for its token's block reduction, at the
// cost of the bytes ptxas spills under the cap. (v3 tried the same with the next token's rows
// loaded ahead in registers, and did not beat v2 on an H100.)
#include "altup_correct_backward.cuh"

template <int N, int A, bool kActive>
__global__ void ROUTED_BACKWARD_BOUNDS_THREE_BLOCKS altup_correct_backward_v4(CORRECT_BACKWARD_PARAMS) {
    correct_backward<N, A, kActive, SliceMajorSums, UnpackedRows>(CORRECT_BACKWARD_ARGS);
}
