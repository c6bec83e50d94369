// predict_correct_backward_v3.cu: the backward of AltUp's predict + correct step (docs/SPEC.md
// section 2) in one pass with one block reduction per token; notation of
// predict_correct_backward_v1.cu.
//
// What this version changed:
//   v3: one block reduction per token instead of three: every reduction v2 does in rounds 2 and 3
//       is a linear combination of dot products of the raw rows (<g_i, h_j>, <g_i, act>, ...), so
//       one round computes them all (a spread butterfly: V - 1 shuffles for V values); rows read
//       twice through L1 instead of held in registers, S in shared memory: two blocks per SM.
#include "common.cuh"
#include "weight_grad_partials.cuh"
#include "slice_pass.cuh"

// Every per-token reduction of v2's three rounds is a linear combination of dot products of the
// raw rows, which one round can produce together:
//   ss_a = <h_a, h_a>, ss_c = <act, act>, Ap_n = sum_d R[n,d] w_d h_a[d], Ac_n = (same, act),
//   G_ij = <g_i, h_j>, Gc_i = <g_i, act>.
// From them (all exact algebra, derived in notebook 02):
//   gk_i     = <g_i, delta>  = Gc_i - G_ia - sum_j C_aj G_ij
//   <gd,h_j> = sum_l k_l G_lj,   dC_ij = G_ij - [i==a] <gd,h_j>
//   <gu_p,h_a> = (1/H) sum_n gz_p[n] Ap_n,   <gu_c,act> = (1/H) sum_n gz_c[n] Ac_n
// and the element-wise gradients are fixed linear maps of the token's rows:
//   grad_h_j = sum_l B_jl g_l + [j==a] gx_p,   B_jl = (d_lj + C_lj) - (d_aj + C_aj) k_l
//   grad_act = sum_l k_l g_l + gx_c,           gx = w * (R^T alpha) - beta * x,
//   alpha_n = r gz_n / H,  beta = r^3 <gu, x> / H.
// The router and norm-weight gradients need one [N, H] accumulator per block,
//   S[n,d] += r_p gz_p[n] h_a[d] + r_c gz_c[n] act[d],
// since dR[n,d] = w_d S[n,d] / H and dw[d] = sum_n R[n,d] S[n,d] / H.
// So a token costs one pass over its rows and one block reduction of 2 + 2N + N^2 + N values;
// warp 0 turns the totals into the N^2 + 5N + 2 coefficients above and broadcasts them through
// shared memory. Blocks are persistent (several per SM; block b takes tokens b, b + G, ...).
// The rows are not kept in registers across the reduction: the output pass reads them again
// (L1 hits: pass 1 loads them with L1 allocation, pass 2 evict-first). That halves the registers
// per thread, so two blocks fit on an SM where a register-resident version fit one, and it ran
// faster on the H200 (results/h200/NOTES.md).

// LAST_USE: read-once data is loaded evict-first; a first read that will be repeated (the
// non-resident pass 1) is loaded normally so that the second read hits L1.
template <int N, bool LAST_USE>
__device__ __forceinline__ void v3_load(SliceRows<N>& rows, const uint4* __restrict__ grad, const uint4* __restrict__ hs,
                                        const uint4* __restrict__ act, long long token_slice, long long stream_stride) {
#pragma unroll
    for (int i = 0; i < N; ++i) rows.g[i] = LAST_USE ? __ldcs(grad + i * stream_stride + token_slice) : __ldg(grad + i * stream_stride + token_slice);
#pragma unroll
    for (int i = 0; i < N; ++i) rows.h[i] = LAST_USE ? __ldcs(hs + i * stream_stride + token_slice) : __ldg(hs + i * stream_stride + token_slice);
    rows.act = LAST_USE ? __ldcs(act + token_slice) : __ldg(act + token_slice);
}

// Per-token scalars in shared memory, written by warp 0 in stages (lanes in parallel, each lane
// holding a few values, so the rows the other warps keep in registers are not crowded out).
template <int N>
struct V3Scalars {
    float m_p[N], m_c[N], C[N * N], k[N], gk[N], gd_h[N], dC[N * N], gz_p[N], gz_c[N];
};

// Warp 0 turns one token's reduced values into the broadcast coefficients, and adds this
// token's contribution to the block's coefficient gradients (in shared memory, each entry owned
// by one lane, as an fp32 sum and its rounding error: add_product_compensated).
template <int N, int A>
__device__ __forceinline__ void v3_token_scalars(const float* __restrict__ t, V3Scalars<N>& sc, float* __restrict__ coefs,
                                                 const float* __restrict__ P, const float* __restrict__ Q,
                                                 float inv_h, float eps, float* __restrict__ coef_grads,
                                                 float* __restrict__ coef_grad_errors) {
    using L = SliceLayout<N>;
    const int lane = threadIdx.x & 31;
    const float r_p = rsqrtf(t[L::kSsA] * inv_h + eps);
    const float r_c = rsqrtf(t[L::kSsC] * inv_h + eps);
    const float* G = t + L::kG;  // G[i * N + j] = <g_i, h_j>
    // 1. router outputs m = tanh(R xn)
    if (lane < N) sc.m_p[lane] = tanhf(r_p * t[L::kAp + lane] * inv_h);
    else if (lane < 2 * N) sc.m_c[lane - N] = tanhf(r_c * t[L::kAc + lane - N] * inv_h);
    __syncwarp();
    // 2. C = P m_p (as [N][N]) and k = Q m_c + 1
    if (lane < N * N) {
        float c = 0.0f;
        for (int l = 0; l < N; ++l) c = fmaf(P[lane * N + l], sc.m_p[l], c);
        sc.C[lane] = c;
    } else if (lane < N * N + N) {
        const int i = lane - N * N;
        float kk = 1.0f;
        for (int l = 0; l < N; ++l) kk = fmaf(Q[i * N + l], sc.m_c[l], kk);
        sc.k[i] = kk;
    }
    __syncwarp();
    // 3. gk_i = <g_i, delta> and <gd, h_j>
    if (lane < N) {
        const int i = lane;
        float v = t[L::kGc + i] - G[i * N + A];
        for (int j = 0; j < N; ++j) v = fmaf(-sc.C[A * N + j], G[i * N + j], v);
        sc.gk[i] = v;
    } else if (lane < 2 * N) {
        const int j = lane - N;
        float v = 0.0f;
        for (int l = 0; l < N; ++l) v = fmaf(sc.k[l], G[l * N + j], v);
        sc.gd_h[j] = v;
    }
    __syncwarp();
    // 4. dC_ij = <gpred_i, h_j>
    if (lane < N * N) sc.dC[lane] = G[lane] - (lane / N == A ? sc.gd_h[lane % N] : 0.0f);
    __syncwarp();
    // 5. through tanh: gz_c = (Q^T gk)(1 - m_c^2), gz_p = (P^T dC)(1 - m_p^2)
    if (lane < N) {
        const int l = lane;
        float gm = 0.0f;
        for (int i = 0; i < N; ++i) gm = fmaf(Q[i * N + l], sc.gk[i], gm);
        sc.gz_c[l] = gm * (1.0f - sc.m_c[l] * sc.m_c[l]);
    } else if (lane < 2 * N) {
        const int l = lane - N;
        float gm = 0.0f;
        for (int ij = 0; ij < N * N; ++ij) gm = fmaf(P[ij * N + l], sc.dC[ij], gm);
        sc.gz_p[l] = gm * (1.0f - sc.m_p[l] * sc.m_p[l]);
    }
    __syncwarp();
    // 6. coefficient gradients: dP[N*i+j][l] += dC_ij m_p[l], dQ[i][l] += gk_i m_c[l]
    for (int e = lane; e < L::kCoefGrads; e += 32) {
        if (e < N * N * N) add_product_compensated(coef_grads[e], coef_grad_errors[e], sc.dC[e / N], sc.m_p[e % N]);
        else add_product_compensated(coef_grads[e], coef_grad_errors[e], sc.gk[(e - N * N * N) / N],
                                     sc.m_c[(e - N * N * N) % N]);
    }
    // 7. the broadcast coefficients
    for (int c = lane; c < L::kCoefs; c += 32) {
        float value;
        if (c < L::kK) {  // B[j][l] = (d_lj + C_lj) - (d_aj + C_aj) k_l
            const int j = c / N, l = c % N;
            value = ((l == j ? 1.0f : 0.0f) + sc.C[l * N + j]) - ((A == j ? 1.0f : 0.0f) + sc.C[A * N + j]) * sc.k[l];
        } else if (c < L::kAlphaP) {
            value = sc.k[c - L::kK];
        } else if (c < L::kAlphaC) {
            value = r_p * sc.gz_p[c - L::kAlphaP] * inv_h;
        } else if (c < L::kBetaP) {
            value = r_c * sc.gz_c[c - L::kAlphaC] * inv_h;
        } else if (c < L::kSigmaP) {  // beta = r^3 <gu, x> / H,  <gu, x> = (1/H) sum_n gz_n (R w x)_n
            const bool predict = c == L::kBetaP;
            const float r = predict ? r_p : r_c;
            float gu = 0.0f;
            for (int n = 0; n < N; ++n)
                gu = fmaf(predict ? sc.gz_p[n] : sc.gz_c[n], t[(predict ? L::kAp : L::kAc) + n], gu);
            value = r * r * r * gu * inv_h * inv_h;
        } else if (c < L::kSigmaC) {
            value = r_p * sc.gz_p[c - L::kSigmaP];
        } else {
            value = r_c * sc.gz_c[c - L::kSigmaC];
        }
        coefs[c] = value;
    }
}

// What v3 keeps in static shared memory: the reduction's per-warp sums, the token's totals,
// scalars and broadcast coefficients, the block's coefficient gradients, and the coefficient
// matrices in fp32 (v4: V4Shared). The coefficient gradients live here, not in warp 0's
// registers: every thread runs the same code, so registers held for warp 0 are held by all, and
// at N = 4 with two blocks per SM (96 registers a thread) they made sm_86/sm_89 builds spill.
// For the same reason they are fp32 pairs, not fp64: an fp64 accumulator (v4's) spilled.
template <int N>
struct V3Shared {
    float scratch[SliceLayout<N>::kValues][33];  // per-warp partial sums (+1: no bank conflicts)
    float totals[SliceLayout<N>::kValues];
    float coefs[SliceLayout<N>::kCoefs];
    V3Scalars<N> token_scalars;
    float coef_grads[SliceLayout<N>::kCoefGrads];        // the block's dP | dQ partials
    float coef_grad_errors[SliceLayout<N>::kCoefGrads];  // and their rounding errors
    float P[N * N * N], Q[N * N];  // read by warp 0 for every token
};

// One block reduction of the token's dot products (each warp by a spread butterfly, lane l ending
// with value l, then warp 0 sums the warps in a fixed order), then warp 0's scalar phase. Ends on
// a barrier, with sh.coefs holding the token's broadcast coefficients.
template <int N, int A>
__device__ __forceinline__ void v3_reduce_token(float (&v)[SliceLayout<N>::kValuesPow2], V3Shared<N>& sh, float inv_h,
                                                float eps) {
    using L = SliceLayout<N>;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    {
        const float warp_total = warp_sum_spread<L::kValuesPow2>(v);
        if (lane < L::kValues) sh.scratch[lane][warp] = warp_total;
    }
    __syncthreads();
    if (warp == 0) {
        sum_warp_totals<N>(sh.scratch, sh.totals, warps);
        __syncwarp();
        v3_token_scalars<N, A>(sh.totals, sh.token_scalars, sh.coefs, sh.P, sh.Q, inv_h, eps, sh.coef_grads,
                               sh.coef_grad_errors);
    }
    __syncthreads();
}

template <int N, int A, int SLICES, int MIN_BLOCKS>
__global__ void __launch_bounds__(MIN_BLOCKS == 1 ? ALTUP_V3_ONE_BLOCK_THREADS : ALTUP_V3_TWO_BLOCK_THREADS, MIN_BLOCKS)
predict_correct_backward_v3(SINGLE_PASS_BACKWARD_PARAMETERS) {
    using L = SliceLayout<N>;
    extern __shared__ float S[];  // [N][SLICES][8][blockDim.x]: this block's S
    __shared__ V3Shared<N> sh;
    for (int e = threadIdx.x; e < L::kCoefGrads; e += blockDim.x) sh.coef_grads[e] = sh.coef_grad_errors[e] = 0.0f;
    stage_coefficients<N>(sh, P, Q);  // its barrier also publishes the zeros

    const int slices = hidden / kVec;
    const long long stream_stride = tokens * slices;  // in 16-byte slices; can pass 2^31
    const float inv_h = 1.0f / static_cast<float>(hidden);
    auto s_at = [&](int n, int c, int e) -> float& { return S[((n * SLICES + c) * kVec + e) * blockDim.x + threadIdx.x]; };
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int c = 0; c < SLICES; ++c)
#pragma unroll
            for (int e = 0; e < kVec; ++e) s_at(n, c, e) = 0.0f;

    SliceRows<N> r;  // one 8-element slice of the token's rows
    for (long long token = blockIdx.x; token < tokens; token += gridDim.x) {
        const long long token_slice0 = token * slices;
        float v[L::kValuesPow2] = {};  // the values, then zeros up to a power of two
#pragma unroll 1  // one slice at a time: SLICES costs no registers
        for (int c = 0; c < SLICES; ++c) {
            const int slice = threadIdx.x + c * blockDim.x;
            if (slice >= slices) continue;
            v3_load<N, false>(r, grad, hs, act, token_slice0 + slice, stream_stride);
            slice_dot_products<N, A>(r, RouterTimesNormFromWeights<N>(router, norm, slice, slices), v);
        }
        v3_reduce_token<N, A>(v, sh, inv_h, eps);
#pragma unroll 1
        for (int c = 0; c < SLICES; ++c) {
            const int slice = threadIdx.x + c * blockDim.x;
            if (slice >= slices) continue;
            v3_load<N, true>(r, grad, hs, act, token_slice0 + slice, stream_stride);
            slice_accumulate_s<N, A>(r, sh.coefs, [&](int n, int e) -> float& { return s_at(n, c, e); });
            slice_output<N, A>(r, RouterTimesNormFromWeights<N>(router, norm, slice, slices), sh.coefs, grad_act + token_slice0 + slice, grad_hs + token_slice0 + slice,
                                  stream_stride);
        }
    }

    float* part = partials + blockIdx.x * partial_stride(N, hidden);
#pragma unroll
    for (int c = 0; c < SLICES; ++c) {
        const int slice = threadIdx.x + c * blockDim.x;
        if (slice >= slices) continue;
        float s[N][kVec];
#pragma unroll
        for (int n = 0; n < N; ++n)
#pragma unroll
            for (int e = 0; e < kVec; ++e) s[n][e] = s_at(n, c, e);
        slice_write_router_partials<N>(part, s, router, norm, slice, slices, inv_h);
    }
    if (threadIdx.x < 32) {
        write_coef_grad_partials<N>(part, hidden, [&](int e) {
            return static_cast<double>(sh.coef_grads[e]) + sh.coef_grad_errors[e];
        });
    }
}
