// altup_predict_backward.cuh: the backward of Gemma 3n's AltUp predict step (the forward and
// its math: altup_predict_forward_v1.cu), the body its versions share. A version is one
// altup_predict_backward_v<n>.cu: it says what it changed and defines its kernel
// altup_predict_backward_v<n><N, A, kActive> by naming two policies, where the router's
// weight-gradient sums live in shared memory (Sums, altup_rows.cuh) and where a token's rows live
// between their loads and their uses (Rows, below or in the version's file). Every version gives
// the same bits.
//
// A fixed grid of blocks walks the tokens (block b: tokens b, b + grid, ...), so every block's
// weight-gradient partial sums its tokens in a fixed order; altup_router_grads_v1 then sums the
// partials in block order: bitwise deterministic. Per token, ONE block reduction gives every dot
// product the step needs (<h_a, h_a>, A_n = sum_d R_nd w_d h_a,d, G_ij = <g_i, h_j>):
//   dC = G;  gm_p = P^T dC;  grad_h_j = g_j + sum_i C_ij g_i + [j == a] route_backward(h_a, gm_p)
//   partial layout per block: S [N, H] (S_nd = sum_t r gz_n h_a,d) | dP [N*N*N] (sum_t G_ij m_l)
// and altup_router_grads_v1 finishes dR = s w S, dw = s sum_n R_n S_n (s: the router's input
// scale). (A version that copied the block's next token into shared memory by cp.async while this
// one was worked on measured slower than v3 at every M once v3 no longer paid for a runtime
// grad_active test: removed. So did v3 capped at 80 registers, three blocks an SM instead of two:
// 195.0 against 163.6 us at M = 8192 on an H100, the spilled bytes costing more than the third
// block's loads in flight gave; results/nvidia-h100-80gb-hbm3/gemma3n_kernels_a12a872.csv.)
// Where the model reads the active prediction through a tensor of its own (`active_prediction`,
// the forward's optional second output), its gradient arrives apart from g's (`grad_active`) and
// is added to g_a as the rows are loaded, with the rounding of the bf16 addition autograd would
// otherwise make in a pass of its own over all N rows. Whether it is given is a template argument
// (kActive): without it the kernel issues no extra load and tests no pointer (a runtime test and a
// dummy load in every version cost 20-35% at M = 8192 on an H100). The active index A is a
// template argument so that every row array is indexed by constants (registers, no local memory).
#pragma once
#include "common.cuh"
#include "altup_rows.cuh"

// Where a token's rows are in memory: row j of h and of g, and its row of grad_active (read only
// where kActive).
struct TokenRows {
    const unsigned short* hidden_states;
    const unsigned short* grad_predictions;
    const unsigned short* grad_active;
    long long plane;
    int hidden;
    __device__ __forceinline__ const unsigned short* h(const long long t, const int j) const {
        return hidden_states + j * plane + t * hidden;
    }
    __device__ __forceinline__ const unsigned short* g(const long long t, const int i) const {
        return grad_predictions + i * plane + t * hidden;
    }
    __device__ __forceinline__ const unsigned short* active_g(const long long t) const {
        return grad_active + t * hidden;
    }
};

// Where the backward keeps a token's rows (the policy Rows): `h(j, out)` and `g(i, out)` give row
// j of h and row i of g unpacked to fp32, g_A with this token's row of grad_active added. Each is
// built for token t by Rows(slice, rows, t, ahead), where `ahead` (of the policy's type Ahead,
// made once a block) is what the policy carries from one of the block's tokens to its next.
//
// GradRowsReloaded (v1, v2): registers bound the blocks per SM, so a thread holds the N rows of h
// unpacked and lets the rows of g pass through one at a time: once for the dot products, then once
// per output row after the block reduction (N + N^2 loads a token). The first pass reads g through
// L1 (`load_reused`), so the later ones hit there instead of going back to memory.
template <int N, int A, bool kActive>
struct GradRowsReloaded {
    using Ahead = NothingAhead;
    float rows_h[N][kVec];
    RowSlice slice;
    const unsigned short* grad_row;  // this token's g_0
    const unsigned short* active_grad_row;
    long long plane;
    __device__ __forceinline__ GradRowsReloaded(const RowSlice& slice, const TokenRows& rows, const long long t, Ahead&)
        : slice(slice), grad_row(rows.g(t, 0)), active_grad_row(kActive ? rows.active_g(t) : nullptr),
          plane(rows.plane) {
#pragma unroll
        for (int j = 0; j < N; ++j) slice.load(rows.h(t, j), rows_h[j]);
    }
    __device__ __forceinline__ void h(const int j, float (&out)[kVec]) const {
#pragma unroll
        for (int e = 0; e < kVec; ++e) out[e] = rows_h[j][e];
    }
    __device__ __forceinline__ void g(const int i, float (&out)[kVec]) const {
        slice.load_reused(grad_row + i * plane, out);
        if (kActive && i == A) {
            float extra[kVec];
            slice.load_reused(active_grad_row, extra);
#pragma unroll
            for (int e = 0; e < kVec; ++e) out[e] += extra[e];
            round_bf16x8(out);
        }
    }
};

// The kernel's arguments, which every version takes in this order (the host's argument list,
// gemma3n_kernels.KERNELS), and their names as the body receives them.
#define PREDICT_BACKWARD_PARAMS                                                                         \
    const unsigned short* __restrict__ grad_predictions,  /* [N, M, H] bf16 */                          \
    const unsigned short* __restrict__ grad_active,       /* [M, H] bf16, added to row A where kActive */ \
    const unsigned short* __restrict__ hidden_states,     /* [N, M, H] bf16 */                          \
    const unsigned short* __restrict__ prediction_coefs,  /* [N*N, N] bf16 */                           \
    const unsigned short* __restrict__ router_weight,     /* [N, H] bf16 */                             \
    const unsigned short* __restrict__ norm_weight,       /* [H] bf16 */                                \
    unsigned short* __restrict__ grad_hidden_states,      /* [N, M, H] bf16 */                          \
    float* __restrict__ partials,                         /* [gridDim.x, partial_stride] fp32 */        \
    const long long partial_stride, const long long tokens, const int hidden, const float eps,          \
    const float router_scale
#define PREDICT_BACKWARD_ARGS                                                                           \
    grad_predictions, grad_active, hidden_states, prediction_coefs, router_weight, norm_weight,         \
    grad_hidden_states, partials, partial_stride, tokens, hidden, eps, router_scale

// The body of every version: Sums and Rows are the version's policies.
template <int N, int A, bool kActive, typename Sums, template <int, int, bool> class Rows>
__device__ __forceinline__ void predict_backward(PREDICT_BACKWARD_PARAMS) {
    constexpr int kSums = 1 + N + N * N;
    __shared__ float scratch[32 * kSums];
    __shared__ float P[N * N * N];
    __shared__ float coefs[N * N + N];  // this token's C + I, then gm
    load_small_matrix(prediction_coefs, P, N * N * N);
    const RowSlice slice(hidden);
    const RouterSlice<N> router{slice, router_weight, norm_weight, hidden};
    const long long plane = tokens * hidden;

    extern __shared__ float S[];  // in the layout Sums (altup_rows.cuh)
    clear_weight_sums<N, Sums>(S, slice, hidden);
    const TokenRows token_rows{hidden_states, grad_predictions, grad_active, plane, hidden};
    float dP = 0.0f;  // thread e < N^3 owns dP entry e = (N*i + j) * N + l
    typename Rows<N, A, kActive>::Ahead ahead(slice, token_rows, blockIdx.x, tokens);
    for (long long t = blockIdx.x; t < tokens; t += gridDim.x) {
        const Rows<N, A, kActive> rows(slice, token_rows, t, ahead);
        float sums[kSums];
        {
            float ha[kVec];
            rows.h(A, ha);
            sums[0] = dot8(ha, ha);
            router.project(ha, sums + 1);
        }
#pragma unroll
        for (int i = 0; i < N; ++i) {
            float g[kVec];
            rows.g(i, g);
#pragma unroll
            for (int j = 0; j < N; ++j) {
                float hj[kVec];
                rows.h(j, hj);
                sums[1 + N + N * i + j] = dot8(g, hj);
            }
        }
        block_sum_spread(sums, scratch);
        const float* Ap = sums + 1;
        const float* G = sums + 1 + N;
        const RouterScalars<N> route(sums[0], Ap, hidden, eps, router_scale);

        // N^2 threads form this token's C_ij + [i == j] and N more gm = P^T G, once for the
        // block: every thread then reads N^2 + N numbers, where forming them itself read P 2 N^3
        // times (the kernel is bound by its loads, not its arithmetic).
        if (threadIdx.x < N * N) {
            const int e = threadIdx.x;  // N * i + j
            float c = (e / N == e % N) ? 1.0f : 0.0f;
#pragma unroll
            for (int l = 0; l < N; ++l) c = fmaf(P[e * N + l], route.m[l], c);
            coefs[e] = c;
        } else if (threadIdx.x < N * N + N) {
            const int l = threadIdx.x - N * N;
            float sum = 0.0f;
#pragma unroll
            for (int r = 0; r < N * N; ++r) sum = fmaf(P[r * N + l], G[r], sum);
            coefs[N * N + l] = sum;
        }
        __syncthreads();
        float gm[N];
#pragma unroll
        for (int l = 0; l < N; ++l) gm[l] = coefs[N * N + l];
        float gz[N], alpha[N];
        const float beta = route.backward(gm, Ap, router_scale, gz, alpha);
        // constant indices only (a register array indexed by threadIdx would go to local memory)
#pragma unroll
        for (int e = 0; e < N * N * N; ++e) {
            if (threadIdx.x == e) dP = fmaf(G[e / N], route.m[e % N], dP);
        }

#pragma unroll
        for (int j = 0; j < N; ++j) {
            float out[kVec];
            if (j == A) {
                float ha[kVec];
                rows.h(A, ha);
                router.input_grad(alpha, beta, ha, out);
            } else {
                RowSlice::zeros(out);
            }
#pragma unroll
            for (int i = 0; i < N; ++i) {
                float g[kVec];
                rows.g(i, g);
                const float c = coefs[N * i + j];
#pragma unroll
                for (int e = 0; e < kVec; ++e) out[e] = fmaf(c, g[e], out[e]);
            }
            slice.store(grad_hidden_states + j * plane + t * hidden, out);
        }
        float ha[kVec];
        rows.h(A, ha);
        accumulate_weight_sums<N, Sums>(S, slice, hidden, route.r, gz, ha);
    }
    store_weight_partials<N, N * N * N, Sums>(S, dP, slice, partials, partial_stride, hidden);
}
