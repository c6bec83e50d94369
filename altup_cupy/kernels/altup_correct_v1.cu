// altup_correct_v1.cu: Gemma 3n's AltUp correct step, forward and backward (one autograd node).
//
//   m_c = route(x);  k = Q m_c + 1;  corrected_i = pred_i + k_i (x - pred_a)     (x = activated)
//
// Forward: one block per token; reads the N predictions and x once, writes N rows once.
// Backward: a fixed grid of blocks walks the tokens (see altup_predict_v1.cu for why). Per token,
// ONE block reduction gives <x, x>, A_n = sum_d R_nd w_d x_d, <g_i, x> and <g_i, pred_a>:
//   gk_i = <g_i, x> - <g_i, pred_a>;  gd = sum_i k_i g_i;  grad_pred_i = g_i - [i == a] gd
//   grad_x = gd + route_backward(x, Q^T gk)
//   partial layout per block: S [N, H] (S_nd = sum_t r gz_n x_d) | dQ [N*N] (sum_t gk_i m_l),
//   S accumulated in shared memory in the layout Sums (the backward's versions: as in
//   altup_predict_v1.cu);
//   altup_router_grads_v1 sums the partials in block order and finishes dR = s w S,
//   dw = s sum_n R_n S_n (s: the router's input scale)
// Only the active prediction row is read in the backward: the other rows do not reach a gradient.
// Where the model reads the corrected active row through a tensor of its own (`active_corrected`,
// the forward's optional second output), its gradient arrives apart (`grad_active`) and is added
// to g_a as it is loaded, rounded as autograd's bf16 addition would round it; whether it is given
// is a template argument (kActive), so the kernel without it loads and tests nothing more.
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

template <int N, int A, bool kActive, typename Sums>
__global__ void ROUTED_BACKWARD_BOUNDS altup_correct_backward(
    const unsigned short* __restrict__ grad_corrected,    // [N, M, H] bf16
    const unsigned short* __restrict__ grad_active,       // [M, H] bf16, added to row A; read where kActive
    const unsigned short* __restrict__ predictions,       // [N, M, H] bf16 (row A read)
    const unsigned short* __restrict__ activated,         // [M, H] bf16
    const unsigned short* __restrict__ correction_coefs,  // [N, N] bf16
    const unsigned short* __restrict__ router_weight,     // [N, H] bf16
    const unsigned short* __restrict__ norm_weight,       // [H] bf16
    unsigned short* __restrict__ grad_predictions,        // [N, M, H] bf16
    unsigned short* __restrict__ grad_activated,          // [M, H] bf16
    float* __restrict__ partials,                         // [gridDim.x, partial_stride] fp32
    const long long partial_stride, const long long tokens, const int hidden, const float eps,
    const float router_scale) {
    constexpr int kSums = 1 + 3 * N;
    __shared__ float scratch[32 * kSums];
    __shared__ float Q[N * N];
    load_small_matrix(correction_coefs, Q, N * N);
    const RowSlice slice(hidden);
    const RouterSlice<N> router{slice, router_weight, norm_weight, hidden};
    const long long plane = tokens * hidden;

    extern __shared__ float S[];  // in the layout Sums (altup_rows.cuh)
    clear_weight_sums<N, Sums>(S, slice, hidden);
    float dQ = 0.0f;  // thread e < N^2 owns dQ entry e = N*i + l
    for (long long t = blockIdx.x; t < tokens; t += gridDim.x) {
        float g[N][kVec], x[kVec], pred_a[kVec];
#pragma unroll
        for (int i = 0; i < N; ++i) slice.load(grad_corrected + i * plane + t * hidden, g[i]);
        float extra[kVec];
        if (kActive) slice.load(grad_active + t * hidden, extra);
        slice.load(activated + t * hidden, x);
        slice.load(predictions + A * plane + t * hidden, pred_a);
        if (kActive) {
#pragma unroll
            for (int e = 0; e < kVec; ++e) g[A][e] += extra[e];
            round_bf16x8(g[A]);
        }
        float sums[kSums];
        sums[0] = dot8(x, x);
        router.project(x, sums + 1);
#pragma unroll
        for (int i = 0; i < N; ++i) {
            sums[1 + N + i] = dot8(g[i], x);
            sums[1 + 2 * N + i] = dot8(g[i], pred_a);
        }
        block_sum_spread(sums, scratch);
        const float* Ac = sums + 1;
        const RouterScalars<N> route(sums[0], Ac, hidden, eps, router_scale);

        float gk[N], gm[N], k[N];
#pragma unroll
        for (int i = 0; i < N; ++i) gk[i] = sums[1 + N + i] - sums[1 + 2 * N + i];
        matrix_vector<N, N>(Q, route.m, 1.0f, k);
        transposed_matrix_vector<N, N>(Q, gk, gm);
        float gz[N], alpha[N];
        const float beta = route.backward(gm, Ac, router_scale, gz, alpha);
#pragma unroll
        for (int i = 0; i < N * N; ++i) {
            if (threadIdx.x == i) dQ = fmaf(gk[i / N], route.m[i % N], dQ);
        }

        float gd[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) gd[e] = 0.0f;
#pragma unroll
        for (int i = 0; i < N; ++i) {
#pragma unroll
            for (int e = 0; e < kVec; ++e) gd[e] = fmaf(k[i], g[i][e], gd[e]);
        }
#pragma unroll
        for (int i = 0; i < N; ++i) {
            if (i == A) {
#pragma unroll
                for (int e = 0; e < kVec; ++e) g[i][e] -= gd[e];
            }
            slice.store(grad_predictions + i * plane + t * hidden, g[i]);
        }
        float gx[kVec];
        router.input_grad(alpha, beta, x, gx);
#pragma unroll
        for (int e = 0; e < kVec; ++e) gx[e] += gd[e];
        slice.store(grad_activated + t * hidden, gx);
        accumulate_weight_sums<N, Sums>(S, slice, hidden, route.r, gz, x);
    }
    store_weight_partials<N, N * N, Sums>(S, dQ, slice, partials, partial_stride, hidden);
}
