// predict_correct_backward_v1.cu: the backward of AltUp's predict + correct step (docs/SPEC.md
// section 2), step by step.
//
// Notation (per token t; N streams, H hidden, a = active index, w = norm_weight, R = router_weight,
// P = prediction_coefs [N*N, N], Q = correction_coefs [N, N]; the derivation is written out in
// altup_cupy/reference/predict_correct.py, whose names these kernels reuse):
//   forward : r = rsqrt(mean(x^2)+eps), xn = x*r*w/H, m = tanh(R xn)    (x = h_a -> m_p, act -> m_c)
//             C = P m_p, k = Q m_c + 1, pred_a = h_a + sum_j C[a][j] h_j, delta = act - pred_a
//   backward: gd = sum_i k_i g_i, gk_i = <g_i, delta>, gpred_i = g_i - [i==a] gd,
//             dC_ij = <gpred_i, h_j>, gz_c = (Q^T gk)(1 - m_c^2), gz_p = (P^T dC)(1 - m_p^2),
//             gxn = R^T gz, gu = gxn*w/H, gx = r*gu - r^3 * x * <gu, x> / H,
//             grad_h_j = gpred_j + sum_i C_ij gpred_i + [j==a] gx_p, grad_act = gd + gx_c,
//             dR += gz (x) xn, dw += gxn * x*r / H, dP[N*i+j][l] += dC_ij m_p_l, dQ[i][l] += gk_i m_c_l.
// The other versions (predict_correct_backward_v2/v3/v4.cu) use this notation.
//
// What this version changed:
//   v1: one small kernel per derivation stage, intermediates in global scratch, any H, readable.
#include "common.cuh"
#include "weight_grad_partials.cuh"
#include "stream_grads.cuh"

__device__ __forceinline__ void load_row8(const uint4* p, float (&v)[kVec]) { unpack_bf16x8(__ldg(p), v); }

// Per-token scratch `stats` [M, TokenStats<N>::size] fp32 holds the per-token scalars of every
// stage; the two router-backward row terms gx_p, gx_c go to fp32 scratch rows [M, H].
template <int N>
struct TokenStats {
    static constexpr int r_p = 0, r_c = 1;
    static constexpr int m_p = 2, m_c = m_p + N;
    static constexpr int C = m_c + N, k = C + N * N;
    static constexpr int gk = k + N, gz_c = gk + N;
    static constexpr int dC = gz_c + N, gz_p = dC + N * N;
    static constexpr int size = gz_p + N;
};

// The host sizes `stats` from the same layout (_sources.TOKEN_STATS_SIZE): a drift fails here.
static_assert(TokenStats<2>::size == ALTUP_TOKEN_STATS_SIZE_2, "_sources.TOKEN_STATS_SIZE, N = 2");
static_assert(TokenStats<3>::size == ALTUP_TOKEN_STATS_SIZE_3, "_sources.TOKEN_STATS_SIZE, N = 3");
static_assert(TokenStats<4>::size == ALTUP_TOKEN_STATS_SIZE_4, "_sources.TOKEN_STATS_SIZE, N = 4");


// Stage 1, forward statistics and router outputs (one block per token):
//   r_p, r_c, m_p = route(h_a), m_c = route(act), C = P m_p, k = Q m_c + 1.
template <int N>
__global__ void __launch_bounds__(ALTUP_V1_THREADS) predict_correct_backward_v1_forward_stats(
    const uint4* __restrict__ hs, const uint4* __restrict__ act, const unsigned short* __restrict__ P,
    const unsigned short* __restrict__ Q, const uint4* __restrict__ R, const uint4* __restrict__ w,
    float* __restrict__ stats, const int hidden, const long long tokens, const int a, const float eps) {
    using S = TokenStats<N>;
    __shared__ float scratch[32 * (2 + 2 * N)];
    const int slices = hidden / kVec;
    const long long t = blockIdx.x;
    const uint4* h_a = hs + (static_cast<long long>(a) * tokens + t) * slices;
    const uint4* x = act + t * slices;
    float acc[2 + 2 * N];  // sum h_a^2, sum act^2, sum R_n w h_a, sum R_n w act
#pragma unroll
    for (int i = 0; i < 2 + 2 * N; ++i) acc[i] = 0.0f;
    for (int s = threadIdx.x; s < slices; s += blockDim.x) {
        float hv[kVec], xv[kVec], wv[kVec];
        load_row8(h_a + s, hv); load_row8(x + s, xv); load_row8(w + s, wv);
#pragma unroll
        for (int e = 0; e < kVec; ++e) { acc[0] += hv[e] * hv[e]; acc[1] += xv[e] * xv[e]; }
#pragma unroll
        for (int n = 0; n < N; ++n) {
            float rv[kVec];
            load_row8(R + static_cast<long long>(n) * slices + s, rv);
#pragma unroll
            for (int e = 0; e < kVec; ++e) {
                acc[2 + n] += rv[e] * wv[e] * hv[e];
                acc[2 + N + n] += rv[e] * wv[e] * xv[e];
            }
        }
    }
    block_sum<2 + 2 * N>(acc, scratch);
    if (threadIdx.x != 0) return;
    const float inv_h = 1.0f / static_cast<float>(hidden);
    const float r_p = 1.0f / sqrtf(acc[0] * inv_h + eps), r_c = 1.0f / sqrtf(acc[1] * inv_h + eps);
    float* st = stats + t * S::size;
    st[S::r_p] = r_p;
    st[S::r_c] = r_c;
    float m_p[N], m_c[N];
#pragma unroll
    for (int n = 0; n < N; ++n) {
        m_p[n] = tanhf(acc[2 + n] * r_p * inv_h);
        m_c[n] = tanhf(acc[2 + N + n] * r_c * inv_h);
        st[S::m_p + n] = m_p[n];
        st[S::m_c + n] = m_c[n];
    }
    for (int q = 0; q < N * N; ++q) {
        float c = 0.0f;
        for (int l = 0; l < N; ++l) c += bf16_lo(P[q * N + l]) * m_p[l];
        st[S::C + q] = c;
    }
    for (int i = 0; i < N; ++i) {
        float k = 1.0f;
        for (int l = 0; l < N; ++l) k += bf16_lo(Q[i * N + l]) * m_c[l];
        st[S::k + i] = k;
    }
}

// Stage 2, correction-coefficient gradients (one block per token): gk_i = <g_i, delta>,
// delta = act - pred_a, pred_a = h_a + sum_j C[a][j] h_j.
template <int N>
__global__ void __launch_bounds__(ALTUP_V1_THREADS) predict_correct_backward_v1_correction_grads(
    const uint4* __restrict__ grad, const uint4* __restrict__ hs, const uint4* __restrict__ act,
    float* __restrict__ stats, const int hidden, const long long tokens, const int a) {
    using S = TokenStats<N>;
    __shared__ float scratch[32 * N];
    const int slices = hidden / kVec;
    const long long t = blockIdx.x;
    float* st = stats + t * S::size;
    float Ca[N];
#pragma unroll
    for (int j = 0; j < N; ++j) Ca[j] = st[S::C + a * N + j];
    float gk[N];
#pragma unroll
    for (int i = 0; i < N; ++i) gk[i] = 0.0f;
    for (int s = threadIdx.x; s < slices; s += blockDim.x) {
        float delta[kVec], v[kVec];
        load_row8(act + t * slices + s, delta);
#pragma unroll
        for (int j = 0; j < N; ++j) {
            load_row8(hs + (j * tokens + t) * slices + s, v);
            const float cj = Ca[j] + (j == a ? 1.0f : 0.0f);  // pred_a = h_a + sum_j C[a][j] h_j
#pragma unroll
            for (int e = 0; e < kVec; ++e) delta[e] -= cj * v[e];
        }
#pragma unroll
        for (int i = 0; i < N; ++i) {
            load_row8(grad + (i * tokens + t) * slices + s, v);
#pragma unroll
            for (int e = 0; e < kVec; ++e) gk[i] += v[e] * delta[e];
        }
    }
    block_sum<N>(gk, scratch);
    if (threadIdx.x == 0)
        for (int i = 0; i < N; ++i) st[S::gk + i] = gk[i];
}

// One slice of the token's g_i (at grad + i * plane + slice) into gpred_i = g_i - [i==a] gd, with
// gd = sum_i k_i g_i; shared by stages 4 and 6. `a` is a runtime value: a 0/1 factor, not
// `if (i == a)`, which the compiler may turn into a runtime index into gpred and so into local memory.
template <int N>
__device__ __forceinline__ void v1_gpred_slice(const uint4* __restrict__ grad, const long long plane,
                                               const long long slice, const float* __restrict__ k, const int a,
                                               float (&gpred)[N][kVec], float (&gd)[kVec]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        load_row8(grad + i * plane + slice, gpred[i]);
#pragma unroll
        for (int e = 0; e < kVec; ++e) gd[e] += k[i] * gpred[i][e];
    }
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const float is_a = (i == a) ? 1.0f : 0.0f;
#pragma unroll
        for (int e = 0; e < kVec; ++e) gpred[i][e] = fmaf(-is_a, gd[e], gpred[i][e]);
    }
}

// Router backward for one token, shared by stages 3 and 5: given gz (already in stats), writes
//   gx = r*gu - r^3 * x * <gu, x> / H,  gu = (R^T gz) * w / H     as an fp32 row.
template <int N>
__device__ __forceinline__ void v1_router_backward_row(
    const uint4* __restrict__ x, const uint4* __restrict__ R, const uint4* __restrict__ w,
    const float (&gz)[N], const float r, float* __restrict__ gx_row, const int hidden, float* scratch) {
    const int slices = hidden / kVec;
    const float inv_h = 1.0f / static_cast<float>(hidden);
    // Slice s of x and w, and gxn = R^T gz there (both passes recompute it rather than store it).
    auto load_slice = [&](int s, float (&xv)[kVec], float (&wv)[kVec], float (&gxn)[kVec]) {
        float rv[kVec];
        load_row8(x + s, xv); load_row8(w + s, wv);
#pragma unroll
        for (int n = 0; n < N; ++n) {
            load_row8(R + static_cast<long long>(n) * slices + s, rv);
#pragma unroll
            for (int e = 0; e < kVec; ++e) gxn[e] += rv[e] * gz[n];
        }
    };
    float dot[1] = {0.0f};  // <gu, x>
    for (int s = threadIdx.x; s < slices; s += blockDim.x) {
        float xv[kVec], wv[kVec], gxn[kVec] = {};
        load_slice(s, xv, wv, gxn);
#pragma unroll
        for (int e = 0; e < kVec; ++e) dot[0] += gxn[e] * wv[e] * inv_h * xv[e];
    }
    block_sum<1>(dot, scratch);
    const float coef = r * r * r * dot[0] * inv_h;
    for (int s = threadIdx.x; s < slices; s += blockDim.x) {
        float xv[kVec], wv[kVec], gxn[kVec] = {};
        load_slice(s, xv, wv, gxn);
#pragma unroll
        for (int e = 0; e < kVec; ++e) gx_row[s * kVec + e] = r * gxn[e] * wv[e] * inv_h - coef * xv[e];
    }
}

// Stages 3 and 5 for one token (one block): the router's gz = (M^T dM)(1 - m^2), stored in the
// token's stats, then the gradient row gx of its input x (row x_row of x_rows). M: the router's
// coefficient matrix (Q, or P as [N*N, N]: ROWS rows of N, bf16); dM, m, r and gz sit in the
// token's stats at dm_at, m_at, r_at and gz_at.
template <int N, int ROWS>
__device__ __forceinline__ void v1_router_backward(const unsigned short* __restrict__ M, float* __restrict__ stats,
                                                   const int dm_at, const int m_at, const int r_at, const int gz_at,
                                                   const uint4* __restrict__ x_rows, const long long x_row,
                                                   const uint4* __restrict__ R, const uint4* __restrict__ w,
                                                   float* __restrict__ gx, const int hidden) {
    __shared__ float scratch[32];
    const int slices = hidden / kVec;
    const long long t = blockIdx.x;
    float* st = stats + t * TokenStats<N>::size;
    float gz[N];
#pragma unroll
    for (int l = 0; l < N; ++l) {
        float gm = 0.0f;
#pragma unroll
        for (int i = 0; i < ROWS; ++i) gm += bf16_lo(M[i * N + l]) * st[dm_at + i];
        const float m = st[m_at + l];
        gz[l] = gm * (1.0f - m * m);
    }
    __syncthreads();  // every thread has read stats before thread 0 writes gz
    if (threadIdx.x == 0)
        for (int l = 0; l < N; ++l) st[gz_at + l] = gz[l];
    v1_router_backward_row<N>(x_rows + x_row * slices, R, w, gz, st[r_at], gx + t * hidden, hidden, scratch);
}

// Stage 3, correct-step router backward (one block per token): gz_c = (Q^T gk)(1 - m_c^2), gx_c.
template <int N>
__global__ void __launch_bounds__(ALTUP_V1_THREADS) predict_correct_backward_v1_correct_router_bwd(
    const uint4* __restrict__ act, const unsigned short* __restrict__ Q, const uint4* __restrict__ R,
    const uint4* __restrict__ w, float* __restrict__ stats, float* __restrict__ gx_c,
    const int hidden, const long long tokens) {
    using S = TokenStats<N>;
    const long long t = blockIdx.x;
    v1_router_backward<N, N>(Q, stats, S::gk, S::m_c, S::r_c, S::gz_c, act, t, R, w, gx_c, hidden);
}

// Stage 4, prediction-coefficient gradients (one block per token): dC_ij = <gpred_i, h_j>,
// gpred_i = g_i - [i==a] gd, gd = sum_i k_i g_i.
template <int N>
__global__ void __launch_bounds__(ALTUP_V1_THREADS) predict_correct_backward_v1_prediction_grads(
    const uint4* __restrict__ grad, const uint4* __restrict__ hs, float* __restrict__ stats,
    const int hidden, const long long tokens, const int a) {
    using S = TokenStats<N>;
    __shared__ float scratch[32 * N * N];
    const int slices = hidden / kVec;
    const long long t = blockIdx.x;
    float* st = stats + t * S::size;
    float k[N];
#pragma unroll
    for (int i = 0; i < N; ++i) k[i] = st[S::k + i];
    float dC[N * N];
#pragma unroll
    for (int q = 0; q < N * N; ++q) dC[q] = 0.0f;
    for (int s = threadIdx.x; s < slices; s += blockDim.x) {
        float g[N][kVec], gd[kVec] = {}, hv[kVec];
        v1_gpred_slice<N>(grad, tokens * slices, t * slices + s, k, a, g, gd);
#pragma unroll
        for (int j = 0; j < N; ++j) {
            load_row8(hs + (j * tokens + t) * slices + s, hv);
#pragma unroll
            for (int i = 0; i < N; ++i)
#pragma unroll
                for (int e = 0; e < kVec; ++e) dC[i * N + j] += g[i][e] * hv[e];
        }
    }
    block_sum<N * N>(dC, scratch);
    if (threadIdx.x == 0)
        for (int q = 0; q < N * N; ++q) st[S::dC + q] = dC[q];
}

// Stage 5, predict-step router backward (one block per token): gz_p = (P^T dC)(1 - m_p^2), gx_p.
template <int N>
__global__ void __launch_bounds__(ALTUP_V1_THREADS) predict_correct_backward_v1_predict_router_bwd(
    const uint4* __restrict__ hs, const unsigned short* __restrict__ P, const uint4* __restrict__ R,
    const uint4* __restrict__ w, float* __restrict__ stats, float* __restrict__ gx_p,
    const int hidden, const long long tokens, const int a) {
    using S = TokenStats<N>;
    const long long t = blockIdx.x;
    v1_router_backward<N, N * N>(P, stats, S::dC, S::m_p, S::r_p, S::gz_p, hs, a * tokens + t, R, w,
                                 gx_p, hidden);
}

// Stage 6, element-wise gradients (one thread per 8-element slice of one token):
//   grad_h_j = gpred_j + sum_i C_ij gpred_i + [j==a] gx_p,  grad_act = gd + gx_c.
template <int N>
__global__ void __launch_bounds__(ALTUP_V1_THREADS) predict_correct_backward_v1_elementwise(
    const uint4* __restrict__ grad, const float* __restrict__ stats, const float* __restrict__ gx_p,
    const float* __restrict__ gx_c, uint4* __restrict__ grad_hs, uint4* __restrict__ grad_act,
    const int hidden, const long long tokens, const int a) {
    using S = TokenStats<N>;
    const int slices = hidden / kVec;
    const long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= tokens * slices) return;
    const long long t = idx / slices;
    const float* st = stats + t * S::size;
    float gpred[N][kVec], gd[kVec] = {};
    v1_gpred_slice<N>(grad, tokens * slices, idx, st + S::k, a, gpred, gd);
#pragma unroll
    for (int j = 0; j < N; ++j) {
        float out[kVec];
        stream_grad_slice<N>(gpred, st + S::C, j, j == a, gx_p + idx * kVec, out);
        grad_hs[j * tokens * slices + idx] = pack_bf16x8(out);
    }
    float out[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) out[e] = gd[e] + gx_c[idx * kVec + e];
    grad_act[idx] = pack_bf16x8(out);
}

// Stage 7a, router and norm weight gradients: block (x = slice group, y = token chunk) sums over
// its tokens in order and writes one partial row (layout of partial_stride):
//   dR[n] += gz_p[n] xn_p + gz_c[n] xn_c,  dw += (gxn_p u_p + gxn_c u_c) / H,  gxn = R^T gz.
template <int N>
__global__ void __launch_bounds__(ALTUP_V1_THREADS) predict_correct_backward_v1_weight_grads(
    const uint4* __restrict__ hs, const uint4* __restrict__ act, const uint4* __restrict__ R,
    const uint4* __restrict__ w, const float* __restrict__ stats, float* __restrict__ partials,
    const int hidden, const long long tokens, const int a, const long long tokens_per_chunk) {
    using S = TokenStats<N>;
    const int slices = hidden / kVec;
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= slices) return;
    const long long first = blockIdx.y * tokens_per_chunk;
    const long long last = min(tokens, first + tokens_per_chunk);
    float rv[N][kVec], wv[kVec];
#pragma unroll
    for (int n = 0; n < N; ++n) load_row8(R + static_cast<long long>(n) * slices + s, rv[n]);
    load_row8(w + s, wv);
    float dR[N][kVec] = {}, dw[kVec] = {};
    const float inv_h = 1.0f / static_cast<float>(hidden);
    for (long long t = first; t < last; ++t) {
        const float* st = stats + t * S::size;
        float hv[kVec], xv[kVec];
        load_row8(hs + (a * tokens + t) * slices + s, hv);
        load_row8(act + t * slices + s, xv);
        const float r_p = st[S::r_p], r_c = st[S::r_c];
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
            const float u_p = hv[e] * r_p, u_c = xv[e] * r_c;
            const float xn_p = u_p * wv[e] * inv_h, xn_c = u_c * wv[e] * inv_h;
            float gxn_p = 0.0f, gxn_c = 0.0f;
#pragma unroll
            for (int n = 0; n < N; ++n) {
                const float gzp = st[S::gz_p + n], gzc = st[S::gz_c + n];
                dR[n][e] += gzp * xn_p + gzc * xn_c;
                gxn_p += rv[n][e] * gzp;
                gxn_c += rv[n][e] * gzc;
            }
            dw[e] += (gxn_p * u_p + gxn_c * u_c) * inv_h;
        }
    }
    float* out = partials + blockIdx.y * partial_stride(N, hidden);
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int e = 0; e < kVec; ++e) out[static_cast<long long>(n) * hidden + s * kVec + e] = dR[n][e];
#pragma unroll
    for (int e = 0; e < kVec; ++e) out[static_cast<long long>(N) * hidden + s * kVec + e] = dw[e];
}

// Stage 7b, coefficient weight gradients: block (x = entry, y = token chunk) sums one entry of
//   dP[N*i+j][l] = sum_t dC_ij m_p_l   or   dQ[i][l] = sum_t gk_i m_c_l   over its tokens,
// in fp64 (weight_grad_partials.cuh says why).
template <int N>
__global__ void __launch_bounds__(ALTUP_V1_THREADS) predict_correct_backward_v1_coef_grads(
    const float* __restrict__ stats, float* __restrict__ partials, const int hidden,
    const long long tokens, const long long tokens_per_chunk) {
    using S = TokenStats<N>;
    __shared__ double scratch[32];
    const int entry = blockIdx.x;  // 0 .. N^3 + N^2 - 1
    int lhs, rhs;
    if (entry < N * N * N) { lhs = S::dC + entry / N; rhs = S::m_p + entry % N; }
    else { const int q = entry - N * N * N; lhs = S::gk + q / N; rhs = S::m_c + q % N; }
    const long long first = blockIdx.y * tokens_per_chunk;
    const long long last = min(tokens, first + tokens_per_chunk);
    double acc[1] = {0.0};
    for (long long t = first + threadIdx.x; t < last; t += blockDim.x)
        acc[0] += static_cast<double>(stats[t * S::size + lhs]) * stats[t * S::size + rhs];
    block_sum<1>(acc, scratch);
    if (threadIdx.x == 0)
        coef_grad_partials<N>(partials + blockIdx.y * partial_stride(N, hidden), hidden)[entry] = acc[0];
}
