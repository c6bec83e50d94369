// altup_predict_forward_v1.cu: Gemma 3n's AltUp predict step, forward.
//
//   m_p = route(h_a);  C[i][j] = (P m_p)[N*i + j];  pred_i = h_i + sum_j C[i][j] h_j
//
// One block per token; reads the N rows once, writes the N predictions once. The active index A
// is a template argument so that every row array is indexed by constants (registers, no local
// memory). Where the model reads the active prediction through a tensor of its own
// (`active_prediction`, an optional second output), row A is also written there.
#include "common.cuh"
#include "altup_rows.cuh"

template <int N, int A>
__global__ void __launch_bounds__(kRowThreadsMax) altup_predict_forward_v1(
    const unsigned short* __restrict__ hidden_states,   // [N, M, H] bf16
    const unsigned short* __restrict__ prediction_coefs,  // [N*N, N] bf16
    const unsigned short* __restrict__ router_weight,   // [N, H] bf16
    const unsigned short* __restrict__ norm_weight,     // [H] bf16
    unsigned short* __restrict__ predictions,           // [N, M, H] bf16
    unsigned short* __restrict__ active_prediction,     // [M, H] bf16, a copy of row A; nullptr: none
    const long long tokens, const int hidden, const float eps, const float router_scale) {
    __shared__ float scratch[32 * (1 + N)];
    __shared__ float P[N * N * N];
    load_small_matrix(prediction_coefs, P, N * N * N);
    const RowSlice slice(hidden);
    const RouterSlice<N> router{slice, router_weight, norm_weight, hidden};
    const long long t = blockIdx.x, plane = tokens * hidden;

    float h[N][kVec];
#pragma unroll
    for (int j = 0; j < N; ++j) slice.load(hidden_states + j * plane + t * hidden, h[j]);
    float sums[1 + N];
    sums[0] = dot8(h[A], h[A]);
    router.project(h[A], sums + 1);
    block_sum(sums, scratch);
    const RouterScalars<N> route(sums[0], sums + 1, hidden, eps, router_scale);

#pragma unroll
    for (int i = 0; i < N; ++i) {
        float pred[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) pred[e] = h[i][e];
#pragma unroll
        for (int j = 0; j < N; ++j) {
            float c = 0.0f;
#pragma unroll
            for (int l = 0; l < N; ++l) c = fmaf(P[(N * i + j) * N + l], route.m[l], c);
#pragma unroll
            for (int e = 0; e < kVec; ++e) pred[e] = fmaf(c, h[j][e], pred[e]);
        }
        slice.store(predictions + i * plane + t * hidden, pred);
        if (i == A && active_prediction != nullptr) slice.store(active_prediction + t * hidden, pred);
    }
}
