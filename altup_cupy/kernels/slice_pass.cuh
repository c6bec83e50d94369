// slice_pass.cuh: the per-slice arithmetic of the single-pass backward (v3, v4, v6): the token's
// dot products (pass 1) and its outputs and S accumulation (pass 2) for one slice of E elements
// (E = 8, one 16-byte word of each row; v6's half slices E = 4, one 8-byte word),
// the value layout of the block reduction, the router/norm partials, and the parameters the
// kernels share. The derivation is in predict_correct_backward_v3.cu.
#pragma once
#include "weight_grad_partials.cuh"

// The parameters the single-pass backward kernels (v3, v4) begin with, in the order the host
// passes them (MAIN_ARGS in ops/predict_correct_backward_versions.py); a kernel adds its own after.
#define SINGLE_PASS_BACKWARD_PARAMETERS                                                       \
    const uint4* __restrict__ grad,        /* [N, M, H] bf16 */                               \
    const uint4* __restrict__ hs,          /* [N, M, H] bf16 */                               \
    const uint4* __restrict__ act,         /* [M, H] bf16 */                                  \
    const unsigned short* __restrict__ P,  /* [N*N, N] bf16 */                                \
    const unsigned short* __restrict__ Q,  /* [N, N] bf16 */                                  \
    const uint4* __restrict__ router,      /* [N, H] bf16 */                                  \
    const uint4* __restrict__ norm,        /* [H] bf16 */                                     \
    uint4* __restrict__ grad_hs,           /* [N, M, H] bf16 */                               \
    uint4* __restrict__ grad_act,          /* [M, H] bf16 */                                  \
    float* __restrict__ partials,          /* [gridDim.x, partial_stride(N, H)] fp32 */       \
    const int hidden, const long long tokens, const float eps

template <int N>
struct SliceLayout {
    // reduced values
    static constexpr int kSsA = 0, kSsC = 1, kAp = 2, kAc = 2 + N, kG = 2 + 2 * N, kGc = 2 + 2 * N + N * N;
    static constexpr int kValues = 2 + 3 * N + N * N;
    static constexpr int kValuesPow2 = next_pow2(kValues);
    // broadcast coefficients
    static constexpr int kB = 0, kK = N * N, kAlphaP = kK + N, kAlphaC = kAlphaP + N, kBetaP = kAlphaC + N,
                         kBetaC = kBetaP + 1, kSigmaP = kBetaC + 1, kSigmaC = kSigmaP + N;
    static constexpr int kCoefs = kSigmaC + N;
    // per-block coefficient-gradient entries: dP (N^3) then dQ (N^2)
    static constexpr int kCoefGrads = N * N * N + N * N;
};

// The token's rows of one E-element slice, packed bf16 (E / 2 registers per row).
template <int N, int E = kVec>
struct SliceRows {
    using Pack = typename Bf16Pack<E>::type;
    Pack g[N];
    Pack h[N];
    Pack act;
};

// The coefficient matrices, bf16 -> fp32, into shared memory (sh.P, sh.Q); ends on a barrier.
template <int N, typename Shared>
__device__ __forceinline__ void stage_coefficients(Shared& sh, const unsigned short* __restrict__ P,
                                                      const unsigned short* __restrict__ Q) {
    for (int i = threadIdx.x; i < N * N * N + N * N; i += blockDim.x) {
        const float value = __uint_as_float(static_cast<unsigned int>(i < N * N * N ? P[i] : Q[i - N * N * N]) << 16);
        if (i < N * N * N) sh.P[i] = value; else sh.Q[i - N * N * N] = value;
    }
    __syncthreads();
}

// R[n] * w of one slice in fp32 from the packed bf16 weights (the router statistics and both
// router backwards use only this product), computed where it is used.
template <int N, int E = kVec>
struct RouterTimesNormFromWeights {
    using Pack = typename Bf16Pack<E>::type;
    Pack rn[N], wn;
    __device__ __forceinline__ RouterTimesNormFromWeights(const Pack* __restrict__ router, const Pack* __restrict__ norm,
                                                 const int slice, const int slices) {
#pragma unroll
        for (int n = 0; n < N; ++n) rn[n] = __ldg(router + n * slices + slice);
        wn = __ldg(norm + slice);
    }
    __device__ __forceinline__ float operator()(const int n, const int e) const { return bf16_at(rn[n], e) * bf16_at(wn, e); }
    // sum_n R[n] w alpha_n at element e, with w factored out (one multiply instead of N).
    __device__ __forceinline__ float dot(const int e, const float* __restrict__ alpha) const {
        float sum = 0.0f;
#pragma unroll
        for (int n = 0; n < N; ++n) sum = fmaf(bf16_at(rn[n], e), alpha[n], sum);
        return bf16_at(wn, e) * sum;
    }
};

// Pass 1 of one slice: its share of the 2 + 3N + N^2 dot products of the raw rows, added to v.
// rw(n, e): R[n] * w at element e of the slice (fp32), fetched where it is used so that it never
// occupies registers across the pass. Router statistics first (h_a, act, R w), then the Gram
// products (g, h, act): two loops keep fewer unpacked values alive at once.
template <int N, int A, typename RouterTimesNorm, int E>
__device__ __forceinline__ void slice_dot_products(const SliceRows<N, E>& r, const RouterTimesNorm& rw,
                                                float (&v)[SliceLayout<N>::kValuesPow2]) {
    using L = SliceLayout<N>;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const float ha = bf16_at(r.h[A], e), ac = bf16_at(r.act, e);
        v[L::kSsA] = fmaf(ha, ha, v[L::kSsA]);
        v[L::kSsC] = fmaf(ac, ac, v[L::kSsC]);
#pragma unroll
        for (int n = 0; n < N; ++n) {
            const float rwe = rw(n, e);
            v[L::kAp + n] = fmaf(rwe, ha, v[L::kAp + n]);
            v[L::kAc + n] = fmaf(rwe, ac, v[L::kAc + n]);
        }
    }
#pragma unroll
    for (int i = 0; i < N; ++i) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const float gi = bf16_at(r.g[i], e);
            v[L::kGc + i] = fmaf(gi, bf16_at(r.act, e), v[L::kGc + i]);
#pragma unroll
            for (int j = 0; j < N; ++j) v[L::kG + i * N + j] = fmaf(gi, bf16_at(r.h[j], e), v[L::kG + i * N + j]);
        }
    }
}

// One warp adds the per-warp sums of `warps` warps in a fixed order: lane l, value l.
template <int N, int COLUMNS>
__device__ __forceinline__ void sum_warp_totals(const float (&scratch)[SliceLayout<N>::kValues][COLUMNS], float* __restrict__ totals,
                                             const int warps) {
    const int lane = threadIdx.x & 31;
    if (lane < SliceLayout<N>::kValues) {
        float total = 0.0f;
        for (int w = 0; w < warps; ++w) total += scratch[lane][w];
        totals[lane] = total;
    }
}

// The block's coefficient-gradient partials (dP then dQ, fp64; entry e is value(e), from shared
// memory) into its partial row, by the warp that accumulated them (v3: warp 0, v4: the scalar warp).
template <int N, typename Value>
__device__ __forceinline__ void write_coef_grad_partials(float* __restrict__ part, const int hidden,
                                                         const Value& value) {
    __syncwarp();  // v4's lane 0 accumulated every entry
    double* out = coef_grad_partials<N>(part, hidden);
    for (int e = threadIdx.x & 31; e < SliceLayout<N>::kCoefGrads; e += 32) out[e] = value(e);
}

// Pass 2, first part: the slice's S[n] += sigma_p[n] h_a + sigma_c[n] act (c: the token's
// broadcast coefficients, SliceLayout). s(n, e): a reference to S[n] at element e of the slice
// (shared memory in v3, registers in v4).
template <int N, int A, typename SliceOfS, int E>
__device__ __forceinline__ void slice_accumulate_s(const SliceRows<N, E>& r, const float* __restrict__ c, const SliceOfS& s) {
    using L = SliceLayout<N>;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const float ha = bf16_at(r.h[A], e), ac = bf16_at(r.act, e);
#pragma unroll
        for (int n = 0; n < N; ++n) {
            float& acc = s(n, e);
            acc = fmaf(c[L::kSigmaP + n], ha, fmaf(c[L::kSigmaC + n], ac, acc));
        }
    }
}

// Pass 2, second part: the slice's activation gradients, written once (evict-first).
// grad_act_out / grad_hs_out point at the slice in grad_act and in stream 0 of grad_hs.
// One output row at a time, so only that row's coefficients and results are live.
template <int N, int A, typename RouterTimesNorm, int E>
__device__ __forceinline__ void slice_output(const SliceRows<N, E>& r, const RouterTimesNorm& rw, const float* __restrict__ c,
                                                typename SliceRows<N, E>::Pack* __restrict__ grad_act_out,
                                                typename SliceRows<N, E>::Pack* __restrict__ grad_hs_out,
                                                const long long stream_stride) {
    using L = SliceLayout<N>;
    {  // grad_act = sum_l k_l g_l + (R w)^T alpha_c - beta_c act
        float out[E];
#pragma unroll
        for (int e = 0; e < E; ++e) {
            float gd = 0.0f;
#pragma unroll
            for (int n = 0; n < N; ++n) gd = fmaf(c[L::kK + n], bf16_at(r.g[n], e), gd);
            out[e] = gd + fmaf(-c[L::kBetaC], bf16_at(r.act, e), rw.dot(e, c + L::kAlphaC));
        }
        __stcs(grad_act_out, pack_bf16(out));
    }
    // grad_h_j = sum_l B_jl g_l (+ (R w)^T alpha_p - beta_p h_a): stream A first, right after
    // grad_act, so the R w products both use are not held across the other rows.
#pragma unroll
    for (int row = 0; row < N; ++row) {
        const int j = row == 0 ? A : (row <= A ? row - 1 : row);
        float out[E];
#pragma unroll
        for (int e = 0; e < E; ++e) {
            float acc = 0.0f;
            if (j == A) {
                acc = fmaf(-c[L::kBetaP], bf16_at(r.h[A], e), rw.dot(e, c + L::kAlphaP));
            }
#pragma unroll
            for (int l = 0; l < N; ++l) acc = fmaf(c[L::kB + j * N + l], bf16_at(r.g[l], e), acc);
            out[e] = acc;
        }
        __stcs(grad_hs_out + j * stream_stride, pack_bf16(out));
    }
}

// One slice of the block's router and norm-weight partials from its S (predict_correct_backward_reduce'
// layout): dR[n,d] = w_d S[n,d] / H, dw[d] = sum_n R[n,d] S[n,d] / H.
template <int N, int E>
__device__ __forceinline__ void slice_write_router_partials(float* __restrict__ part, const float (&s)[N][E],
                                                         const typename Bf16Pack<E>::type* __restrict__ router,
                                                         const typename Bf16Pack<E>::type* __restrict__ norm,
                                                         const int slice, const int slices, const float inv_h) {
    const int hidden = slices * E;
    auto store = [&](float* row, const float (&x)[E]) {  // 16-byte stores (rows stay aligned)
        float4* dst = reinterpret_cast<float4*>(row + slice * E);
#pragma unroll
        for (int q = 0; q < E / 4; ++q) dst[q] = make_float4(x[4 * q], x[4 * q + 1], x[4 * q + 2], x[4 * q + 3]);
    };
    float wn[E], dw[E] = {};
    unpack_bf16(__ldg(norm + slice), wn);
#pragma unroll
    for (int n = 0; n < N; ++n) {  // one row at a time: only its S, R and dR are live
        float rn[E], dR[E];
        unpack_bf16(__ldg(router + n * slices + slice), rn);
#pragma unroll
        for (int e = 0; e < E; ++e) {
            dR[e] = wn[e] * s[n][e] * inv_h;
            dw[e] = fmaf(rn[e], s[n][e], dw[e]);
        }
        store(part + n * hidden, dR);
    }
#pragma unroll
    for (int e = 0; e < E; ++e) dw[e] *= inv_h;
    store(part + N * hidden, dw);
}
