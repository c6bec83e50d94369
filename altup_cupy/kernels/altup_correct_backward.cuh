// altup_correct_backward.cuh: the backward of Gemma 3n's AltUp correct step (the forward and its
// math: altup_correct_forward_v1.cu), the body its versions share. A version is one
// altup_correct_backward_v<n>.cu: it says what it changed and defines its kernel
// altup_correct_backward_v<n><N, A, kActive> by naming two policies, where the router's
// weight-gradient sums live in shared memory (Sums, altup_rows.cuh) and where a token's rows live
// between their loads and their uses (Rows, below or in the version's file). Every version gives
// the same bits.
//
// A fixed grid of blocks walks the tokens (altup_predict_backward.cuh says why). Per token, ONE
// block reduction gives <x, x>, A_n = sum_d R_nd w_d x_d, <g_i, x> and <g_i, pred_a>:
//   gk_i = <g_i, x> - <g_i, pred_a>;  gd = sum_i k_i g_i;  grad_pred_i = g_i - [i == a] gd
//   grad_x = gd + route_backward(x, Q^T gk)
//   partial layout per block: S [N, H] (S_nd = sum_t r gz_n x_d) | dQ [N*N] (sum_t gk_i m_l);
//   altup_router_grads_v1 sums the partials in block order and finishes dR = s w S,
//   dw = s sum_n R_n S_n (s: the router's input scale)
// Only the active prediction row is read: the other rows do not reach a gradient. Where the model
// reads the corrected active row through a tensor of its own (`active_corrected`, the forward's
// optional second output), its gradient arrives apart (`grad_active`) and is added to g_a as it
// is loaded, rounded as autograd's bf16 addition would round it; whether it is given is a template
// argument (kActive), so the kernel without it loads and tests nothing more.
// (v2 capped at 80 registers, three blocks an SM instead of two, measured slower than v2 on an
// H100, 154.6 against 146.6 us at M = 8192: removed; results/nvidia-h100-80gb-hbm3/
// gemma3n_kernels_a12a872.csv.)
#pragma once
#include "common.cuh"
#include "altup_rows.cuh"

// The kernel's arguments, which every version takes in this order (the host's argument list,
// gemma3n_kernels.KERNELS), and their names as the body receives them.
#define CORRECT_BACKWARD_PARAMS                                                                         \
    const unsigned short* __restrict__ grad_corrected,    /* [N, M, H] bf16 */                          \
    const unsigned short* __restrict__ grad_active,       /* [M, H] bf16, added to row A where kActive */ \
    const unsigned short* __restrict__ predictions,       /* [N, M, H] bf16 (row A read) */             \
    const unsigned short* __restrict__ activated,         /* [M, H] bf16 */                             \
    const unsigned short* __restrict__ correction_coefs,  /* [N, N] bf16 */                             \
    const unsigned short* __restrict__ router_weight,     /* [N, H] bf16 */                             \
    const unsigned short* __restrict__ norm_weight,       /* [H] bf16 */                                \
    unsigned short* __restrict__ grad_predictions,        /* [N, M, H] bf16 */                          \
    unsigned short* __restrict__ grad_activated,          /* [M, H] bf16 */                             \
    float* __restrict__ partials,                         /* [gridDim.x, partial_stride] fp32 */        \
    const long long partial_stride, const long long tokens, const int hidden, const float eps,          \
    const float router_scale
#define CORRECT_BACKWARD_ARGS                                                                           \
    grad_corrected, grad_active, predictions, activated, correction_coefs, router_weight, norm_weight,  \
    grad_predictions, grad_activated, partials, partial_stride, tokens, hidden, eps, router_scale

// Where a token's rows are in memory: row i of g, its row of grad_active (read only where
// kActive), x and the active prediction.
struct CorrectTokenRows {
    const unsigned short* grad_corrected;
    const unsigned short* grad_active;
    const unsigned short* predictions;
    const unsigned short* activated;
    long long plane;
    int hidden;
    __device__ __forceinline__ const unsigned short* g(const long long t, const int i) const {
        return grad_corrected + i * plane + t * hidden;
    }
    __device__ __forceinline__ const unsigned short* active_g(const long long t) const {
        return grad_active + t * hidden;
    }
    __device__ __forceinline__ const unsigned short* x(const long long t) const { return activated + t * hidden; }
    __device__ __forceinline__ const unsigned short* pred_a(const long long t, const int a) const {
        return predictions + a * plane + t * hidden;
    }
};

// Where the backward keeps a token's rows (the policy Rows): `g(i, out)`, `x(out)` and
// `pred_a(out)` give row i of g (g_A with this token's row of grad_active added), x and the active
// prediction unpacked to fp32. Each is built for token t by Rows(slice, rows, t, ahead), where
// `ahead` (of the policy's type Ahead, made once a block) is what the policy carries from one of
// the block's tokens to its next.
//
// UnpackedRows (v1, v2): the token's N + 2 rows unpacked in registers, loaded when its turn comes.
template <int N, int A, bool kActive>
struct UnpackedRows {
    using Ahead = NothingAhead;
    float rows_g[N][kVec], row_x[kVec], row_pred_a[kVec];
    __device__ __forceinline__ UnpackedRows(const RowSlice& slice, const CorrectTokenRows& rows, const long long t,
                                            Ahead&) {
#pragma unroll
        for (int i = 0; i < N; ++i) slice.load(rows.g(t, i), rows_g[i]);
        float extra[kVec];
        if (kActive) slice.load(rows.active_g(t), extra);
        slice.load(rows.x(t), row_x);
        slice.load(rows.pred_a(t, A), row_pred_a);
        if (kActive) {
#pragma unroll
            for (int e = 0; e < kVec; ++e) rows_g[A][e] += extra[e];
            round_bf16x8(rows_g[A]);
        }
    }
    __device__ __forceinline__ void g(const int i, float (&out)[kVec]) const { copy8(rows_g[i], out); }
    __device__ __forceinline__ void x(float (&out)[kVec]) const { copy8(row_x, out); }
    __device__ __forceinline__ void pred_a(float (&out)[kVec]) const { copy8(row_pred_a, out); }
    __device__ __forceinline__ static void copy8(const float (&in)[kVec], float (&out)[kVec]) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) out[e] = in[e];
    }
};

// The body of every version: Sums and Rows are the version's policies.
template <int N, int A, bool kActive, typename Sums, template <int, int, bool> class Rows>
__device__ __forceinline__ void correct_backward(CORRECT_BACKWARD_PARAMS) {
    constexpr int kSums = 1 + 3 * N;
    __shared__ float scratch[32 * kSums];
    __shared__ float Q[N * N];
    load_small_matrix(correction_coefs, Q, N * N);
    const RowSlice slice(hidden);
    const RouterSlice<N> router{slice, router_weight, norm_weight, hidden};
    const long long plane = tokens * hidden;

    extern __shared__ float S[];  // in the layout Sums (altup_rows.cuh)
    clear_weight_sums<N, Sums>(S, slice, hidden);
    const CorrectTokenRows token_rows{grad_corrected, grad_active, predictions, activated, plane, hidden};
    float dQ = 0.0f;  // thread e < N^2 owns dQ entry e = N*i + l
    typename Rows<N, A, kActive>::Ahead ahead(slice, token_rows, blockIdx.x, tokens);
    for (long long t = blockIdx.x; t < tokens; t += gridDim.x) {
        const Rows<N, A, kActive> rows(slice, token_rows, t, ahead);
        float sums[kSums];
        {
            float x[kVec];
            rows.x(x);
            sums[0] = dot8(x, x);
            router.project(x, sums + 1);
        }
#pragma unroll
        for (int i = 0; i < N; ++i) {
            float g[kVec], x[kVec], pred_a[kVec];
            rows.g(i, g);
            rows.x(x);
            rows.pred_a(pred_a);
            sums[1 + N + i] = dot8(g, x);
            sums[1 + 2 * N + i] = dot8(g, pred_a);
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
            float g[kVec];
            rows.g(i, g);
#pragma unroll
            for (int e = 0; e < kVec; ++e) gd[e] = fmaf(k[i], g[e], gd[e]);
        }
#pragma unroll
        for (int i = 0; i < N; ++i) {
            float g[kVec];
            rows.g(i, g);
            if (i == A) {
#pragma unroll
                for (int e = 0; e < kVec; ++e) g[e] -= gd[e];
            }
            slice.store(grad_predictions + i * plane + t * hidden, g);
        }
        float x[kVec], gx[kVec];
        rows.x(x);
        router.input_grad(alpha, beta, x, gx);
#pragma unroll
        for (int e = 0; e < kVec; ++e) gx[e] += gd[e];
        slice.store(grad_activated + t * hidden, gx);
        accumulate_weight_sums<N, Sums>(S, slice, hidden, route.r, gz, x);
    }
    store_weight_partials<N, N * N, Sums>(S, dQ, slice, partials, partial_stride, hidden);
}
