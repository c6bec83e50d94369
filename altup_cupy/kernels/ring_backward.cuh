// ring_backward.cuh: the block body of the ring kernels of the predict + correct backward (v4, v6;
// docs/SPEC.md section 2): v3's arithmetic fed by Hopper's bulk-copy engine (sm_90 only); notation
// of predict_correct_backward_v1.cu. Each version's file sets how many elements of a row one
// compute thread owns (E) and its launch bounds.
#pragma once
#include "common.cuh"
#include "weight_grad_partials.cuh"
#include "slice_pass.cuh"
#include "hopper_bulk_copy.cuh"

// Measured on v3 (results/h200/NOTES.md): at one or two blocks per SM the SM issues an
// instruction only every ~3 cycles per scheduler, and about half of the warps' stall time is at
// the block barrier while warp 0 alone turns the token's totals into coefficients. The ring
// kernels keep v3's per-slice arithmetic and change how the work is scheduled:
//  - the rows: one thread streams each token's 2N + 1 rows (one contiguous 2H-byte copy each) into
//    a ring of `stages` shared-memory stages with cp.async.bulk, completing on one mbarrier per
//    stage, two tokens ahead of the compute; both passes read them from shared memory;
//  - the scalar phase: a dedicated warp (the block's last) computes the coefficients of token
//    j - 1 while the compute warps run pass 1 of token j and pass 2 of token j - 2, so one
//    barrier per token separates the stages and no compute warp waits on serial work:
//        compute warps, step j:  pass 1 (token j) -> warp sums   | barrier |  pass 2 (token j - 1)
//        scalar warp,   step j:  sums + scalars (token j - 1)     | barrier |  refill a stage
//    (sums and coefficients double-buffered by token parity);
//  - R * w is computed once per block (fp32, in shared memory, each thread its own slice) and S
//    stays in registers. One slice per compute thread, one block per SM.

// The slice's rows from one stage ([2N+1][slices] packs: g_0..g_{N-1}, h_0..h_{N-1}, act).
template <int N, int E>
__device__ __forceinline__ void ring_read_rows(SliceRows<N, E>& r, const typename SliceRows<N, E>::Pack* stage_slice,
                                               const int slices) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        r.g[i] = stage_slice[i * slices];
        r.h[i] = stage_slice[(N + i) * slices];
    }
    r.act = stage_slice[2 * N * slices];
}

// The slice's R * w in fp32, precomputed once per block: element e of slice x lives in float4
// plane (E / 4) n + e / 4 at index x (consecutive threads, consecutive 16-byte words: no bank
// conflicts). Each thread writes and reads only its own slice, so no barrier guards the planes.
template <int N, int E>
struct RingRouterTimesNorm {
    const float4* planes;  // this thread's slice in plane 0
    int slices;
    __device__ __forceinline__ float operator()(const int n, const int e) const {
        const float4 q = planes[(E / 4 * n + e / 4) * slices];
        const int k = e % 4;
        return k == 0 ? q.x : k == 1 ? q.y : k == 2 ? q.z : q.w;
    }
    // sum_n (R w)[n] alpha_n at element e.
    __device__ __forceinline__ float dot(const int e, const float* __restrict__ alpha) const {
        float sum = 0.0f;
#pragma unroll
        for (int n = 0; n < N; ++n) sum = fmaf((*this)(n, e), alpha[n], sum);
        return sum;
    }
};

// The scalar phase: v3_token_scalars' arithmetic, in the same order, as straight-line code on
// tiny matrices held in registers: every lane of the scalar warp computes the same values (no
// divergence, no shared-memory round trips between steps), so the chain is short; it is the
// critical path of a token when a block has few tokens. The coefficient gradients dP | dQ
// accumulate in fp64 in shared memory (lane 0; weight_grad_partials.cuh says why). v3 keeps the
// lane-parallel form: its warp 0 has 96 registers, and this one needs more for N = 4.
template <int N, int A>
__device__ __forceinline__ void ring_token_scalars(const float* __restrict__ t, float* __restrict__ coefs,
                                                 double* __restrict__ coef_grads, const float* __restrict__ P,
                                                 const float* __restrict__ Q, const float inv_h, const float eps) {
    using L = SliceLayout<N>;
    const float* v = t;
    const float* G = t + L::kG;  // G[i * N + j] = <g_i, h_j>
    const float r_p = rsqrtf(v[L::kSsA] * inv_h + eps);
    const float r_c = rsqrtf(v[L::kSsC] * inv_h + eps);
    // router outputs m = tanh(R xn); C = P m_p (as [N][N]); k = Q m_c + 1
    float m_p[N], m_c[N], C[N * N], k[N];
#pragma unroll
    for (int n = 0; n < N; ++n) {
        m_p[n] = tanhf(r_p * v[L::kAp + n] * inv_h);
        m_c[n] = tanhf(r_c * v[L::kAc + n] * inv_h);
    }
    matrix_vector<N * N, N>(P, m_p, 0.0f, C);
    matrix_vector<N, N>(Q, m_c, 1.0f, k);
    // gk_i = <g_i, delta>; dC_ij = <gpred_i, h_j> = G_ij - [i==a] <gd, h_j>
    float gk[N], dC[N * N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
        float g = v[L::kGc + i] - G[i * N + A];
#pragma unroll
        for (int j = 0; j < N; ++j) g = fmaf(-C[A * N + j], G[i * N + j], g);
        gk[i] = g;
    }
#pragma unroll
    for (int j = 0; j < N; ++j) {
        float gd_h = 0.0f;
#pragma unroll
        for (int l = 0; l < N; ++l) gd_h = fmaf(k[l], G[l * N + j], gd_h);
#pragma unroll
        for (int i = 0; i < N; ++i) dC[i * N + j] = G[i * N + j] - (i == A ? gd_h : 0.0f);
    }
    // through tanh: gz_c = (Q^T gk)(1 - m_c^2), gz_p = (P^T dC)(1 - m_p^2)
    float gz_p[N], gz_c[N];
    transposed_matrix_vector<N, N>(Q, gk, gz_c);
    transposed_matrix_vector<N * N, N>(P, dC, gz_p);
#pragma unroll
    for (int l = 0; l < N; ++l) {
        gz_c[l] *= 1.0f - m_c[l] * m_c[l];
        gz_p[l] *= 1.0f - m_p[l] * m_p[l];
    }
    if ((threadIdx.x & 31) != 0) return;
    // coefficient gradients: dP[N*i+j][l] += dC_ij m_p[l], dQ[i][l] += gk_i m_c[l] (fp64 products: exact)
#pragma unroll
    for (int e = 0; e < N * N * N; ++e) coef_grads[e] += static_cast<double>(dC[e / N]) * m_p[e % N];
#pragma unroll
    for (int e = 0; e < N * N; ++e) coef_grads[N * N * N + e] += static_cast<double>(gk[e / N]) * m_c[e % N];
    // the broadcast coefficients: B[j][l] = (d_lj + C_lj) - (d_aj + C_aj) k_l, k, alpha = r gz / H,
    // beta = r^3 <gu, x> / H with <gu, x> = (1/H) sum_n gz_n (R w x)_n, sigma = r gz
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
        for (int l = 0; l < N; ++l)
            coefs[L::kB + j * N + l] = ((l == j ? 1.0f : 0.0f) + C[l * N + j]) - ((A == j ? 1.0f : 0.0f) + C[A * N + j]) * k[l];
    float gu_p = 0.0f, gu_c = 0.0f;
#pragma unroll
    for (int n = 0; n < N; ++n) {
        coefs[L::kK + n] = k[n];
        coefs[L::kAlphaP + n] = r_p * gz_p[n] * inv_h;
        coefs[L::kAlphaC + n] = r_c * gz_c[n] * inv_h;
        coefs[L::kSigmaP + n] = r_p * gz_p[n];
        coefs[L::kSigmaC + n] = r_c * gz_c[n];
        gu_p = fmaf(gz_p[n], v[L::kAp + n], gu_p);
        gu_c = fmaf(gz_c[n], v[L::kAc + n], gu_c);
    }
    coefs[L::kBetaP] = r_p * r_p * r_p * gu_p * inv_h * inv_h;
    coefs[L::kBetaC] = r_c * r_c * r_c * gu_c * inv_h * inv_h;
}

// A barrier over the whole block that the two warp roles reach from different code: bar.sync
// counts arriving threads, whatever instruction they arrive from, and orders their memory accesses.
__device__ __forceinline__ void block_barrier() { asm volatile("bar.sync 0;" ::: "memory"); }

// Static shared memory of the ring kernels: v3's, with the warp sums and coefficients
// double-buffered by token parity (the scalar warp works one token behind the compute warps).
// COLUMNS: odd (no bank conflicts) and more than the compute warps.
template <int N, int COLUMNS>
struct RingShared {
    float scratch[2][SliceLayout<N>::kValues][COLUMNS];  // per-compute-warp sums
    float totals[SliceLayout<N>::kValues];
    float coefs[2][SliceLayout<N>::kCoefs];
    double coef_grads[SliceLayout<N>::kCoefGrads];  // the block's dP | dQ partials
    float P[N * N * N], Q[N * N];
};

// What a ring kernel's static shared memory takes at N streams (RingShared and the stage barriers):
// each version checks, at the largest N it is built for, the bound its host plans with.
template <int N, int COLUMNS>
constexpr unsigned long long ring_static_shared_bytes() {
    return sizeof(RingShared<N, COLUMNS>) + ALTUP_RING_MAX_STAGES * sizeof(unsigned long long);
}

// Everything a ring block does: its tokens, then its weight-gradient partial row (each warp returns
// once it has written its share). E elements of each row per compute thread (v4: 8, v6: 4).
// Dynamic shared memory (host: ring_shared_bytes): `stages` stages of (2N+1) rows of H bf16, then
// the R * w planes, N * H fp32.
template <int N, int A, int E, int COLUMNS>
__device__ __forceinline__ void ring_block_backward(SINGLE_PASS_BACKWARD_PARAMETERS, const int stages) {
    using L = SliceLayout<N>;
    using Pack = typename SliceRows<N, E>::Pack;
    constexpr int kRows = 2 * N + 1;
    extern __shared__ __align__(16) uint4 ring[];
    Pack* const ring_rows = reinterpret_cast<Pack*>(ring);  // the ring in this kernel's slices
    __shared__ __align__(8) unsigned long long stage_full[ALTUP_RING_MAX_STAGES];
    __shared__ RingShared<N, COLUMNS> sh;
    const Pack* g_rows = reinterpret_cast<const Pack*>(grad);
    const Pack* h_rows = reinterpret_cast<const Pack*>(hs);
    const Pack* act_rows = reinterpret_cast<const Pack*>(act);

    const int slices = hidden / E;
    const long long stream_stride = tokens * slices;  // in slices; can pass 2^31
    const unsigned int row_bytes = static_cast<unsigned int>(slices) * (2u * E);
    const float inv_h = 1.0f / static_cast<float>(hidden);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int compute_warps = static_cast<int>(blockDim.x >> 5) - 1;
    const bool scalar_warp = warp == compute_warps;
    const int slice = threadIdx.x;
    const bool owns_slice = !scalar_warp && slice < slices;
    // This block's tokens: blockIdx.x + j * gridDim.x for j < count (count >= 1: grid <= tokens).
    const long long count = (tokens - blockIdx.x + gridDim.x - 1) / gridDim.x;

    // The block's j-th token into stage `into` (the scalar warp's lane 0 only).
    auto load_token = [&](long long j, int into) {
        const long long token = blockIdx.x + j * gridDim.x;
        Pack* dst = ring_rows + static_cast<long long>(into) * kRows * slices;
        mbarrier_arrive_expect_bytes(&stage_full[into], kRows * row_bytes);
#pragma unroll
        for (int i = 0; i < N; ++i) {
            bulk_copy_to_shared(dst + i * slices, g_rows + i * stream_stride + token * slices, row_bytes, &stage_full[into]);
            bulk_copy_to_shared(dst + (N + i) * slices, h_rows + i * stream_stride + token * slices, row_bytes,
                                &stage_full[into]);
        }
        bulk_copy_to_shared(dst + 2 * N * slices, act_rows + token * slices, row_bytes, &stage_full[into]);
    };

    // The reduction after this kernel (a programmatic launch) may be placed on the GPU now: its
    // blocks wait for this grid's end before they read a partial.
    griddep_launch_dependents();
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) mbarrier_init(&stage_full[s], 1);
        fence_mbarrier_init();
    }
    for (int e = threadIdx.x; e < L::kCoefGrads; e += blockDim.x) sh.coef_grads[e] = 0.0;
    __syncthreads();
    if (scalar_warp && lane == 0)
        for (int j = 0; j < stages && j < count; ++j) load_token(j, j);
    // While the first tokens arrive: P, Q and each compute thread's R * w.
    float4* planes = reinterpret_cast<float4*>(ring_rows + static_cast<long long>(stages) * kRows * slices) + slice;
    const RingRouterTimesNorm<N, E> rw{planes, slices};
    const Pack* router_rows = reinterpret_cast<const Pack*>(router);
    const Pack* norm_row = reinterpret_cast<const Pack*>(norm);
    if (owns_slice) {
        const RouterTimesNormFromWeights<N, E> from_weights(router_rows, norm_row, slice, slices);
#pragma unroll
        for (int n = 0; n < N; ++n)
#pragma unroll
            for (int q = 0; q < E / 4; ++q)
                planes[(E / 4 * n + q) * slices] = make_float4(from_weights(n, 4 * q), from_weights(n, 4 * q + 1),
                                                               from_weights(n, 4 * q + 2), from_weights(n, 4 * q + 3));
    }
    stage_coefficients<N>(sh, P, Q);

    float* part = partials + blockIdx.x * partial_stride(N, hidden);
    if (scalar_warp) {
        int refill = 0;  // the stage that token j - 2 held
        for (long long j = 0; j <= count; ++j) {
            if (j >= 1) {  // token j - 1's warp sums were written before the last barrier
                const int parity = static_cast<int>((j - 1) & 1);
                sum_warp_totals<N>(sh.scratch[parity], sh.totals, compute_warps);
                __syncwarp();
                ring_token_scalars<N, A>(sh.totals, sh.coefs[parity], sh.coef_grads, sh.P, sh.Q, inv_h, eps);
            }
            block_barrier();
            // Past this barrier the compute warps are done with token j - 2 (its pass 2 ran
            // in step j - 1): its stage takes token j - 2 + stages.
            if (j >= 2) {
                if (lane == 0 && j - 2 + stages < count) load_token(j - 2 + stages, refill);
                if (++refill == stages) refill = 0;
            }
        }
        write_coef_grad_partials<N>(part, hidden, [&](int e) { return sh.coef_grads[e]; });
        return;
    }

    float s[N][E] = {};
    SliceRows<N, E> r;
    int stage = 0, previous = 0;  // the stages of tokens j and j - 1
    unsigned int phase = 0;       // the phase of `stage`'s barrier that token j completes
    for (long long j = 0; j <= count; ++j) {
        if (j < count) {  // pass 1 of token j
            mbarrier_wait_parity(&stage_full[stage], phase);
            float v[L::kValuesPow2] = {};
            if (owns_slice) {
                ring_read_rows<N>(r, ring_rows + static_cast<long long>(stage) * kRows * slices + slice, slices);
                slice_dot_products<N, A>(r, rw, v);
            }
            const float warp_total = warp_sum_spread<L::kValuesPow2>(v);
            if (lane < L::kValues) sh.scratch[j & 1][lane][warp] = warp_total;
        }
        block_barrier();
        if (j >= 1 && owns_slice) {  // pass 2 of token j - 1, with the coefficients of the last step
            const long long token = blockIdx.x + (j - 1) * gridDim.x;
            const float* c = sh.coefs[(j - 1) & 1];
            ring_read_rows<N>(r, ring_rows + static_cast<long long>(previous) * kRows * slices + slice, slices);
            slice_accumulate_s<N, A>(r, c, [&](int n, int e) -> float& { return s[n][e]; });
            slice_output<N, A>(r, rw, c, reinterpret_cast<Pack*>(grad_act) + token * slices + slice,
                               reinterpret_cast<Pack*>(grad_hs) + token * slices + slice, stream_stride);
        }
        previous = stage;
        if (++stage == stages) {
            stage = 0;
            phase ^= 1u;
        }
    }
    if (owns_slice) slice_write_router_partials<N>(part, s, router_rows, norm_row, slice, slices, inv_h);
}
