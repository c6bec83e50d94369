// altup_correct_forward_v1.cu: Gemma 3n's AltUp correct step, forward.
//
//   m_c = route(x);  k = Q m_c + 1;  corrected_i = pred_i + k_i (x - pred_a)     (x = activated)
//
// One block per token; reads the N predictions and x once, writes N rows once. Where the model
// reads the corrected active row through a tensor of its own (`active_corrected`, an optional
// second output), row A is also written there.
#include "common.cuh"
#include "altup_rows.cuh"

template <int N, int A>
__global__ void __launch_bounds__(kRowThreadsMax) altup_correct_forward_v1(
    const unsigned short* __restrict__ predictions,       // [N, M, H] bf16
    const unsigned short* __restrict__ activated,         // [M, H] bf16
    const unsigned short* __restrict__ correction_coefs,  // [N, N] bf16
    const unsigned short* __restrict__ router_weight,     // [N, H] bf16
    const unsigned short* __restrict__ norm_weight,       // [H] bf16
    unsigned short* __restrict__ corrected,               // [N, M, H] bf16
    unsigned short* __restrict__ active_corrected,        // [M, H] bf16, a copy of row A; nullptr: none
    const long long tokens, const int hidden, const float eps, const float router_scale) {
    __shared__ float scratch[32 * (1 + N)];
    __shared__ float Q[N * N];
    load_small_matrix(correction_coefs, Q, N * N);
    const RowSlice slice(hidden);
    const RouterSlice<N> router{slice, router_weight, norm_weight, hidden};
    const long long t = blockIdx.x, plane = tokens * hidden;

    float x[kVec], pred[N][kVec];
    slice.load(activated + t * hidden, x);
#pragma unroll
    for (int i = 0; i < N; ++i) slice.load(predictions + i * plane + t * hidden, pred[i]);
    float sums[1 + N];
    sums[0] = dot8(x, x);
    router.project(x, sums + 1);
    block_sum(sums, scratch);
    const RouterScalars<N> route(sums[0], sums + 1, hidden, eps, router_scale);

    float innovation[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) innovation[e] = x[e] - pred[A][e];
#pragma unroll
    for (int i = 0; i < N; ++i) {
        float k = 1.0f;
#pragma unroll
        for (int l = 0; l < N; ++l) k = fmaf(Q[i * N + l], route.m[l], k);
        float out[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) out[e] = fmaf(k, innovation[e], pred[i][e]);
        slice.store(corrected + i * plane + t * hidden, out);
        if (i == A && active_corrected != nullptr) slice.store(active_corrected + t * hidden, out);
    }
}
