// altup_correct_backward_v1.cu: the correct step's backward (altup_correct_backward.cuh), version 1.
//
// What this version is: the weight-gradient sums row-major in shared memory (RowMajorSums: 8-way
// bank conflicts); the token's N rows of g, x and the active prediction unpacked in registers.
#include "altup_correct_backward.cuh"

template <int N, int A, bool kActive>
__global__ void ROUTED_BACKWARD_BOUNDS altup_correct_backward_v1(CORRECT_BACKWARD_PARAMS) {
    correct_backward<N, A, kActive, RowMajorSums, UnpackedRows>(CORRECT_BACKWARD_ARGS);
}
