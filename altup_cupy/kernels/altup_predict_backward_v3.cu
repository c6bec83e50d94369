// altup_predict_backward_v3.cu: the predict step's backward (altup_predict_backward.cuh), version 3.
//
// What this version changed: the token's rows of h and of g stay packed in registers as loaded
// (PackedRows, altup_predict_backward.cuh), so g is read from memory once instead of once per use.
#include "altup_predict_backward.cuh"

template <int N, int A, bool kActive>
__global__ void ROUTED_BACKWARD_BOUNDS altup_predict_backward_v3(PREDICT_BACKWARD_PARAMS) {
    predict_backward<N, A, kActive, SliceMajorSums, PackedRows>(PREDICT_BACKWARD_ARGS);
}
