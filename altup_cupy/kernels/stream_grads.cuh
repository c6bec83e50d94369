// stream_grads.cuh: the hidden-state streams' gradients of the predict + correct backward for
// the versions that form them from gpred (v1 and v2; notation of predict_correct_backward_v1.cu).
#pragma once

// grad_h_j of one 8-element slice: gpred_j + sum_i C_ij gpred_i, plus gx_p on the active stream
// (C row-major [N][N]). v1 and v2 differ only in where C, gpred and gx_p live.
template <int N>
__device__ __forceinline__ void stream_grad_slice(const float (&gpred)[N][kVec], const float* __restrict__ C, const int j,
                                                  const bool active, const float* __restrict__ gx_p, float (&out)[kVec]) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
        float v = gpred[j][e];
#pragma unroll
        for (int i = 0; i < N; ++i) v = fmaf(C[i * N + j], gpred[i][e], v);
        out[e] = active ? v + gx_p[e] : v;
    }
}
