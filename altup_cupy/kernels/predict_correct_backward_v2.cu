// predict_correct_backward_v2.cu: the backward of AltUp's predict + correct step (docs/SPEC.md
// section 2) in one fused pass; notation of predict_correct_backward_v1.cu.
//
// What this version changed:
//   v2: one pass: a persistent block keeps its token's 2N+1 rows in registers (the next token's
//       rows prefetched into shared memory by cp.async), re-reads the router and norm weight
//       slices through L1, merges the per-token reductions into 3 block-reduction rounds, writes
//       the activation gradients once with 16-byte stores and accumulates per-block
//       weight-gradient partials in dynamic shared memory; predict_correct_backward_reduce sums
//       the partials in a fixed order (no atomics).
//   v2 (RESIDENT = false): the same kernel for large H (rows too big for registers): each phase
//       re-reads the token's rows from global memory (L1/L2 hits after the first read).
#include "common.cuh"
#include "weight_grad_partials.cuh"
#include "stream_grads.cuh"

// Grid: a persistent grid of G blocks; block b handles tokens b, b+G, b+2G, ... Thread x owns the
// 8-element slices x, x + blockDim.x, ..., x + (SLICES-1) * blockDim.x of every row.
// RESIDENT: the token's 2N+1 rows live in registers as packed bf16 (and the next token's rows are
// prefetched while this one is computed); router and norm weight slices are re-read (L1 hits:
// registers are better spent on the rows).
// Otherwise (large H) each phase re-reads its rows through L1/L2.
// Per-block partials (layout of partial_stride) are written once at the end.
// The active index A is a template parameter: every selection of stream A is then resolved at
// compile time (a runtime index into a register array would move the array to local memory).
// Weight-gradient accumulators live in dynamic shared memory (registers are for the rows): thread x
// owns the words [(q * kVec + e) * blockDim.x + x] for q = n * SLICES + c (dR_n, slice c) and
// q = N * SLICES + c (dw, slice c): consecutive threads, consecutive banks. Host: smem bytes =
// (N + 1) * SLICES * kVec * blockDim.x * 4.
// Launch bounds (ALTUP_V2_*_THREADS, from _sources.py): 320 threads (one 8-element slice each:
// H <= 2560) keep the resident rows of N <= 3 within ptxas' 168-register cap; N = 4 needs the
// 255-register cap of 256 threads.
template <int N, bool RESIDENT>
struct V2Config {
    static constexpr int max_threads = !RESIDENT ? ALTUP_V2_NONRESIDENT_THREADS
                                       : N == 2  ? ALTUP_V2_RESIDENT_THREADS_2
                                       : N == 3  ? ALTUP_V2_RESIDENT_THREADS_3
                                                 : ALTUP_V2_RESIDENT_THREADS_4;
};

template <int N, int A, int SLICES, bool RESIDENT>
__global__ void __launch_bounds__(V2Config<N, RESIDENT>::max_threads, 1)
predict_correct_backward_v2(const uint4* __restrict__ grad, const uint4* __restrict__ hs, const uint4* __restrict__ act,
            const unsigned short* __restrict__ P_bf16, const unsigned short* __restrict__ Q_bf16,
            const uint4* __restrict__ R, const uint4* __restrict__ w,
            uint4* __restrict__ grad_hs, uint4* __restrict__ grad_act, float* __restrict__ partials,
            const int hidden, const long long tokens, const float eps) {
    constexpr int a = A;
    constexpr int ROWS = 2 * N + 1;
    constexpr int NCOEF = N * N * N + N * N;  // dP entries then dQ entries
    constexpr int NR1 = 2 + 2 * N, NR2 = N + N * N;
    __shared__ float scratch[32 * (NR1 > NR2 ? NR1 : NR2)];
    __shared__ float P[N * N * N], Q[N * N];
    __shared__ float tok[N * N + N + N + N];  // this token's dC | gk | m_p | m_c, for the coef partials
    // Thread i < NCOEF owns entry i of the block's dP | dQ partials, in fp64 (weight_grad_partials.cuh
    // says why) and in shared memory: a register pair held across the token loop cost
    // v2<4, a, 2, false> its second block per SM.
    __shared__ double coef_grads[NCOEF];

    const int slices = hidden / kVec;
    const long long slices_ll = slices;
    const long long stream_stride = tokens * slices_ll;  // in slices; 64-bit
    const float inv_h = 1.0f / static_cast<float>(hidden);

    for (int i = threadIdx.x; i < N * N * N; i += blockDim.x) P[i] = bf16_lo(P_bf16[i]);
    for (int i = threadIdx.x; i < N * N; i += blockDim.x) Q[i] = bf16_lo(Q_bf16[i]);
    // (the __syncthreads at the start of the first block_sum orders these writes before use)

    extern __shared__ __align__(16) float acc_smem[];  // accumulators, then the prefetch stage
    // Slice c of this thread (computed, not stored: the c loops are not unrolled).
    auto slice_of = [&](int c) -> int { return threadIdx.x + c * blockDim.x; };
    auto valid_of = [&](int c) -> bool { return slice_of(c) < slices; };

    // Router and norm weight slices (packed bf16), read where they are used (L1 hits).
    auto load_R = [&](int n, int c) -> uint4 {
        return valid_of(c) ? __ldg(R + n * slices_ll + slice_of(c)) : make_uint4(0, 0, 0, 0);
    };
    auto load_w = [&](int c) -> uint4 {
        return valid_of(c) ? __ldg(w + slice_of(c)) : make_uint4(0, 0, 0, 0);
    };

    // Row r of token t, slice c: r < N -> g_r, r < 2N -> h_{r-N}, r == 2N -> act.
    auto row_ptr = [&](int r, long long t, int c) -> const uint4* {
        if (r < N) return grad + r * stream_stride + t * slices_ll + slice_of(c);
        if (r < 2 * N) return hs + (r - N) * stream_stride + t * slices_ll + slice_of(c);
        return act + t * slices_ll + slice_of(c);
    };
    // RESIDENT: the token's rows live on chip in a double-buffered shared-memory stage filled by
    // cp.async (global -> shared, no registers): the next token's rows are in flight while this
    // one is computed. Each thread copies, and later reads, only its own 16-byte slots
    // stage[buf][(r * SLICES + c) * blockDim.x + x], so a per-thread wait suffices (no barrier).
    uint4* stage = reinterpret_cast<uint4*>(acc_smem + (N + 1) * SLICES * kVec * blockDim.x);
    const int stage_size = ROWS * SLICES * blockDim.x;  // uint4 per buffer
    int buf = 0;
    auto prefetch = [&](long long t, int into) {
#pragma unroll
        for (int r = 0; r < (RESIDENT ? ROWS : 1); ++r)
#pragma unroll 1
            for (int c = 0; c < SLICES; ++c)
                if (valid_of(c))
                    cp_async16(stage + into * stage_size + (r * SLICES + c) * blockDim.x + threadIdx.x,
                               row_ptr(r, t, c));
        cp_async_commit();
    };
    // The row as 8 floats: from the stage when resident, else from memory (L1/L2 after the first).
    auto row = [&](int r, long long t, int c, float (&v)[kVec]) {
        uint4 raw = make_uint4(0, 0, 0, 0);
        if (valid_of(c))
            raw = RESIDENT ? stage[buf * stage_size + (r * SLICES + c) * blockDim.x + threadIdx.x]
                           : __ldg(row_ptr(r, t, c));
        unpack_bf16x8(raw, v);
    };

    // The slice's h_a, act and norm weight, which every round but the second reads.
    auto load_ha_act_w = [&](long long t, int c, float (&hv)[kVec], float (&xv)[kVec], float (&wv)[kVec]) {
        row(N + A, t, c, hv);
        row(2 * N, t, c, xv);
        unpack_bf16x8(load_w(c), wv);
    };
    // f(n, e, R[n] at element e of slice c) for every router row n and element e, one unpacked row
    // at a time (only its 8 values live).
    auto for_router_slice = [&](int c, auto&& f) {
#pragma unroll
        for (int n = 0; n < N; ++n) {
            float rv[kVec];
            unpack_bf16x8(load_R(n, c), rv);
#pragma unroll
            for (int e = 0; e < kVec; ++e) f(n, e, rv[e]);
        }
    };
    // gxn = R^T gz for both routers (p: h_a, c: act) at slice c.
    auto gxn_of = [&](int c, const float (&gz_p)[N], const float (&gz_c)[N], float (&gxn_p)[kVec],
                      float (&gxn_c)[kVec]) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) { gxn_p[e] = 0.0f; gxn_c[e] = 0.0f; }
        for_router_slice(c, [&](int n, int e, float r) {
            gxn_p[e] = fmaf(r, gz_p[n], gxn_p[e]);
            gxn_c[e] = fmaf(r, gz_c[n], gxn_c[e]);
        });
    };
    // The slice's g_i and gd = sum_i k_i g_i.
    auto load_g_and_gd = [&](long long t, int c, const float (&k)[N], float (&g)[N][kVec], float (&gd)[kVec]) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) gd[e] = 0.0f;
#pragma unroll
        for (int i = 0; i < N; ++i) {
            row(i, t, c, g[i]);
#pragma unroll
            for (int e = 0; e < kVec; ++e) gd[e] = fmaf(k[i], g[i][e], gd[e]);
        }
    };

    // Per-block weight-gradient partials.
    auto acc = [&](int q, int e) -> float& { return acc_smem[(q * kVec + e) * blockDim.x + threadIdx.x]; };
#pragma unroll
    for (int q = 0; q < (N + 1) * SLICES; ++q)
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc(q, e) = 0.0f;
    if (threadIdx.x < NCOEF) coef_grads[threadIdx.x] = 0.0;
    int coef_lhs = 0, coef_rhs = 0;
    if (threadIdx.x < N * N * N) { coef_lhs = threadIdx.x / N; coef_rhs = N * N + N + threadIdx.x % N; }
    else if (threadIdx.x < NCOEF) {
        const int q = threadIdx.x - N * N * N;
        coef_lhs = N * N + q / N; coef_rhs = N * N + 2 * N + q % N;
    }

    const long long stride = gridDim.x;
    long long t = blockIdx.x;
    if (RESIDENT && t < tokens) { prefetch(t, 0); cp_async_wait_all(); }
    for (; t < tokens; t += stride) {
        if (RESIDENT) {
            if (t + stride < tokens) prefetch(t + stride, buf ^ 1);  // in flight during this token
        }

        // ---- round 1: sum h_a^2, sum act^2, sum R_n w h_a, sum R_n w act
        float r1[NR1];
#pragma unroll
        for (int i = 0; i < NR1; ++i) r1[i] = 0.0f;
#pragma unroll 1
        for (int c = 0; c < SLICES; ++c) {
            float hv[kVec], xv[kVec], wv[kVec];
            load_ha_act_w(t, c, hv, xv, wv);
#pragma unroll
            for (int e = 0; e < kVec; ++e) { r1[0] = fmaf(hv[e], hv[e], r1[0]); r1[1] = fmaf(xv[e], xv[e], r1[1]); }
            for_router_slice(c, [&](int n, int e, float r) {
                const float rw = r * wv[e];
                r1[2 + n] = fmaf(rw, hv[e], r1[2 + n]);
                r1[2 + N + n] = fmaf(rw, xv[e], r1[2 + N + n]);
            });
        }
        block_sum<NR1>(r1, scratch);
        const float r_p = 1.0f / sqrtf(r1[0] * inv_h + eps), r_c = 1.0f / sqrtf(r1[1] * inv_h + eps);
        float m_p[N], m_c[N], C[N * N], k[N];
#pragma unroll
        for (int n = 0; n < N; ++n) {
            m_p[n] = tanhf(r1[2 + n] * r_p * inv_h);
            m_c[n] = tanhf(r1[2 + N + n] * r_c * inv_h);
        }
        matrix_vector<N * N, N>(P, m_p, 0.0f, C);
        matrix_vector<N, N>(Q, m_c, 1.0f, k);
        // pred_a = sum_j Ca[j] h_j with Ca[j] = C[a][j] + [j==a]
        float Ca[N];
#pragma unroll
        for (int j = 0; j < N; ++j) Ca[j] = C[A * N + j] + (j == A ? 1.0f : 0.0f);

        // ---- round 2: gk_i = <g_i, delta>, dC_ij = <gpred_i, h_j>
        float r2[NR2];
#pragma unroll
        for (int i = 0; i < NR2; ++i) r2[i] = 0.0f;
#pragma unroll 1
        for (int c = 0; c < SLICES; ++c) {
            float g[N][kVec], gd[kVec], delta[kVec];
            row(2 * N, t, c, delta);
            load_g_and_gd(t, c, k, g, gd);
#pragma unroll
            for (int j = 0; j < N; ++j) {
                float hv[kVec];
                row(N + j, t, c, hv);
#pragma unroll
                for (int e = 0; e < kVec; ++e) delta[e] = fmaf(-Ca[j], hv[e], delta[e]);
            }
#pragma unroll
            for (int i = 0; i < N; ++i)
#pragma unroll
                for (int e = 0; e < kVec; ++e) r2[i] = fmaf(g[i][e], delta[e], r2[i]);
#pragma unroll
            for (int i = 0; i < N; ++i)
                if (i == a)
#pragma unroll
                    for (int e = 0; e < kVec; ++e) g[i][e] -= gd[e];  // g_i -> gpred_i
#pragma unroll
            for (int j = 0; j < N; ++j) {
                float hv[kVec];
                row(N + j, t, c, hv);
#pragma unroll
                for (int i = 0; i < N; ++i)
#pragma unroll
                    for (int e = 0; e < kVec; ++e) r2[N + i * N + j] = fmaf(g[i][e], hv[e], r2[N + i * N + j]);
            }
        }
        block_sum<NR2>(r2, scratch);
        // gz_c = (Q^T gk)(1 - m_c^2), gz_p = (P^T dC)(1 - m_p^2); r2 = gk | dC
        float gz_c[N], gz_p[N];
#pragma unroll
        for (int l = 0; l < N; ++l) {
            float gm_c = 0.0f, gm_p = 0.0f;
#pragma unroll
            for (int i = 0; i < N; ++i) gm_c = fmaf(Q[i * N + l], r2[i], gm_c);
#pragma unroll
            for (int q = 0; q < N * N; ++q) gm_p = fmaf(P[q * N + l], r2[N + q], gm_p);
            gz_c[l] = gm_c * (1.0f - m_c[l] * m_c[l]);
            gz_p[l] = gm_p * (1.0f - m_p[l] * m_p[l]);
        }
        if (threadIdx.x == 0) {
#pragma unroll
            for (int q = 0; q < N * N; ++q) tok[q] = r2[N + q];
#pragma unroll
            for (int i = 0; i < N; ++i) {
                tok[N * N + i] = r2[i];
                tok[N * N + N + i] = m_p[i];
                tok[N * N + 2 * N + i] = m_c[i];
            }
        }

        // ---- round 3: s_p = <gu_p, h_a>, s_c = <gu_c, act>, gu = (R^T gz) w / H
        float r3[2] = {0.0f, 0.0f};
#pragma unroll 1
        for (int c = 0; c < SLICES; ++c) {
            float hv[kVec], xv[kVec], wv[kVec], gxn_p[kVec], gxn_c[kVec];
            load_ha_act_w(t, c, hv, xv, wv);
            gxn_of(c, gz_p, gz_c, gxn_p, gxn_c);
#pragma unroll
            for (int e = 0; e < kVec; ++e) {
                r3[0] = fmaf(gxn_p[e] * wv[e], hv[e], r3[0]);
                r3[1] = fmaf(gxn_c[e] * wv[e], xv[e], r3[1]);
            }
        }
        block_sum<2>(r3, scratch);  // its barriers also publish tok[] (written by thread 0 above)
        if (threadIdx.x < NCOEF) coef_grads[threadIdx.x] += static_cast<double>(tok[coef_lhs]) * tok[coef_rhs];
        // gx = r gu - r^3 x <gu, x> / H, with <gu, x> = r3 / H
        const float coef_p = r_p * r_p * r_p * r3[0] * inv_h * inv_h;
        const float coef_c = r_c * r_c * r_c * r3[1] * inv_h * inv_h;
        const float rp_h = r_p * inv_h, rc_h = r_c * inv_h;

        // ---- element-wise outputs and the weight-gradient partials
#pragma unroll 1
        for (int c = 0; c < SLICES; ++c) {
            float hv[kVec], xv[kVec], wv[kVec], gxn_p[kVec], gxn_c[kVec];
            load_ha_act_w(t, c, hv, xv, wv);
            gxn_of(c, gz_p, gz_c, gxn_p, gxn_c);
            float gx_p[kVec], gx_c[kVec];
#pragma unroll
            for (int e = 0; e < kVec; ++e) {
                // gu = gxn w / H; gx = r gu - coef x
                gx_p[e] = fmaf(rp_h * gxn_p[e], wv[e], -coef_p * hv[e]);
                gx_c[e] = fmaf(rc_h * gxn_c[e], wv[e], -coef_c * xv[e]);
                // xn = x r w / H; dR_n += gz_p[n] xn_p + gz_c[n] xn_c
                const float xn_p = hv[e] * rp_h * wv[e], xn_c = xv[e] * rc_h * wv[e];
#pragma unroll
                for (int n = 0; n < N; ++n) {
                    float& dR = acc(n * SLICES + c, e);
                    dR = fmaf(gz_p[n], xn_p, fmaf(gz_c[n], xn_c, dR));
                }
                // dw += (gxn_p u_p + gxn_c u_c) / H with u = x r
                float& dw = acc(N * SLICES + c, e);
                dw = fmaf(gxn_p[e] * hv[e], rp_h, fmaf(gxn_c[e] * xv[e], rc_h, dw));
            }
            if (valid_of(c)) {
                float g[N][kVec], gd[kVec];
                load_g_and_gd(t, c, k, g, gd);
#pragma unroll
                for (int i = 0; i < N; ++i)
                    if (i == a)
#pragma unroll
                        for (int e = 0; e < kVec; ++e) g[i][e] -= gd[e];  // gpred
                const long long out_slice = t * slices_ll + slice_of(c);
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    float o[kVec];
                    stream_grad_slice<N>(g, C, j, j == a, gx_p, o);
                    __stcs(grad_hs + j * stream_stride + out_slice, pack_bf16x8(o));
                }
                float o[kVec];
#pragma unroll
                for (int e = 0; e < kVec; ++e) o[e] = gd[e] + gx_c[e];
                __stcs(grad_act + out_slice, pack_bf16x8(o));
            }
        }

        if (RESIDENT) { cp_async_wait_all(); buf ^= 1; }
    }

    // ---- this block's partials
    float* out = partials + blockIdx.x * partial_stride(N, hidden);
#pragma unroll 1
    for (int c = 0; c < SLICES; ++c) {
        if (!valid_of(c)) continue;
        const long long e0 = static_cast<long long>(slice_of(c)) * kVec;
#pragma unroll
        for (int n = 0; n <= N; ++n) {  // dR_0 .. dR_{N-1}, then dw (n = N)
            float4* p = reinterpret_cast<float4*>(out + n * static_cast<long long>(hidden) + e0);
            const int q = n * SLICES + c;
            p[0] = make_float4(acc(q, 0), acc(q, 1), acc(q, 2), acc(q, 3));
            p[1] = make_float4(acc(q, 4), acc(q, 5), acc(q, 6), acc(q, 7));
        }
    }
    if (threadIdx.x < NCOEF) coef_grad_partials<N>(out, hidden)[threadIdx.x] = coef_grads[threadIdx.x];
}
