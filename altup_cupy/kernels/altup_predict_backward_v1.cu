// altup_predict_backward_v1.cu: the predict step's backward (altup_predict_backward.cuh), version 1.
//
// What this version is: the weight-gradient sums row-major in shared memory (RowMajorSums: 8-way
// bank conflicts), the token's rows of h unpacked in registers and its rows of g reloaded through
// L1 where they are used (GradRowsReloaded).
#include "altup_predict_backward.cuh"

template <int N, int A, bool kActive>
__global__ void ROUTED_BACKWARD_BOUNDS altup_predict_backward_v1(PREDICT_BACKWARD_PARAMS) {
    predict_backward<N, A, kActive, RowMajorSums, GradRowsReloaded>(PREDICT_BACKWARD_ARGS);
}
