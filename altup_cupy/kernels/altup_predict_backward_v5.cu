// altup_predict_backward_v5.cu: the predict step's backward (altup_predict_backward.cuh), version 5.
//
// What this version changed: v3 (PackedRows) capped at 80 registers a thread, so that three blocks
// share an SM instead of two (ROUTED_BACKWARD_BOUNDS_THREE_BLOCKS, altup_rows.cuh). A block waits
// for its block reduction before it can write a token's rows; with two blocks an SM that wait is
// not hidden, and on the H200 v3 takes 1.5-1.6x its copy floor at M = 4096-8192. A third block
// keeps more loads in flight during it, at the cost of the bytes ptxas spills under the cap.
#include "altup_predict_backward.cuh"

template <int N, int A, bool kActive>
__global__ void ROUTED_BACKWARD_BOUNDS_THREE_BLOCKS altup_predict_backward_v5(PREDICT_BACKWARD_PARAMS) {
    predict_backward<N, A, kActive, SliceMajorSums, PackedRows>(PREDICT_BACKWARD_ARGS);
}
