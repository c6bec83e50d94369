// altup_correct_backward_v2.cu: the correct step's backward (altup_correct_backward.cuh), version 2.
//
// What this version changed: the weight-gradient sums slice-major (SliceMajorSums, altup_rows.cuh):
// lanes read consecutive words, no bank conflict; 48 KiB of shared memory at N = 4, so an SM of
// 100 KiB (sm_86, sm_89) holds one block where it holds two of v1.
#include "altup_correct_backward.cuh"

template <int N, int A, bool kActive>
__global__ void ROUTED_BACKWARD_BOUNDS altup_correct_backward_v2(CORRECT_BACKWARD_PARAMS) {
    correct_backward<N, A, kActive, SliceMajorSums, UnpackedRows>(CORRECT_BACKWARD_ARGS);
}
