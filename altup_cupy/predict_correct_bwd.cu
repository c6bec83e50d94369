// predict_correct_bwd.cu: the backward of AltUp's predict + correct step (docs/SPEC.md section 2).
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
//
// Versions (one line each on what changed):
//   v1: one small kernel per derivation stage, intermediates in global scratch, any H, readable.
//   v2: one pass: a persistent block keeps its token's 2N+1 rows in registers (prefetching the
//       next token's), merges the per-token reductions into 3 block-reduction rounds, writes the
//       activation gradients once with 16-byte stores and keeps per-block weight-gradient partials
//       in registers; pc_reduce_partials sums the partials in a fixed order (no atomics).
//   v2 (RESIDENT = false): the same kernel for large H (rows too big for registers): each phase
//       re-reads the token's rows from global memory (L1/L2 hits after the first read).
//   v3: one block reduction per token instead of three: every reduction v2 does in rounds 2 and 3
//       is a linear combination of dot products of the raw rows (<g_i, h_j>, <g_i, act>, ...), so
//       one round computes them all (a spread butterfly: V - 1 shuffles for V values); rows read
//       twice through L1 instead of held in registers, S in shared memory: two blocks per SM.
//   v4: v3's arithmetic with the rows streamed into a ring of shared-memory stages by the bulk-copy
//       engine (cp.async.bulk + mbarrier), two tokens ahead, and the scalar phase on a dedicated
//       warp one token behind the compute warps: one barrier per token, no warp idle behind warp 0.
#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// Shared pieces
// ---------------------------------------------------------------------------------------------

// Per-block weight-gradient partial layout (floats): dR [N*H] | dw [H] | dP [N*N*N] | dQ [N*N].
__host__ __device__ constexpr long long partial_stride(int n, int hidden) {
    return static_cast<long long>(n + 1) * hidden + n * n * n + n * n;
}

// out[e] = the sum over blocks b of partials[b * stride + e], written to the four fp32 weight
// gradients. A block of 1024 threads takes 128 consecutive entries as 32 float4 columns: warp y
// sums blocks y, y + 32, y + 64, ... (four interleaved chains keep loads in flight; the partials
// were just written and sit in L2, so what costs is latency), then warp 0 adds the 32 warp sums in
// a fixed order. Deterministic: a fixed summation order, no atomics. The stride is a multiple of
// 4 floats for every supported N and H (host: partial_stride), so rows stay 16-byte aligned.
template <int N>
__global__ void __launch_bounds__(1024) pc_reduce_partials(
    const float4* __restrict__ partials, const int blocks, const int hidden,
    float* __restrict__ grad_router,  // [N, H]
    float* __restrict__ grad_norm,    // [H]
    float* __restrict__ grad_pred,    // [N*N, N]
    float* __restrict__ grad_corr) {  // [N, N]
    constexpr int kGroups = 32;
    __shared__ float4 sums[kGroups][32];
    const long long stride4 = partial_stride(N, hidden) / 4;
    const int col = threadIdx.x & 31, group = threadIdx.x >> 5;
    const long long e4 = static_cast<long long>(blockIdx.x) * 32 + col;
    auto add = [](float4& s, const float4 x) { s.x += x.x; s.y += x.y; s.z += x.z; s.w += x.w; };
    float4 s[4] = {};
    if (e4 < stride4) {
        int b = group;
        for (; b + 3 * kGroups < blocks; b += 4 * kGroups) {
#pragma unroll
            for (int k = 0; k < 4; ++k) add(s[k], partials[(b + k * kGroups) * stride4 + e4]);
        }
        for (; b < blocks; b += kGroups) add(s[0], partials[b * stride4 + e4]);
    }
    add(s[0], s[1]);
    add(s[2], s[3]);
    add(s[0], s[2]);
    sums[group][col] = s[0];
    __syncthreads();
    if (group != 0 || e4 >= stride4) return;
    float4 total = {};
#pragma unroll
    for (int g = 0; g < kGroups; ++g) add(total, sums[g][col]);
    const float values[4] = {total.x, total.y, total.z, total.w};
    const long long nh = static_cast<long long>(N) * hidden;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const long long e = 4 * e4 + q;
        if (e < nh) grad_router[e] = values[q];
        else if (e < nh + hidden) grad_norm[e - nh] = values[q];
        else if (e < nh + hidden + N * N * N) grad_pred[e - nh - hidden] = values[q];
        else grad_corr[e - nh - hidden - N * N * N] = values[q];
    }
}

// cp.async: a 16-byte global -> shared copy that bypasses registers (and L1: .cg).
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src) {
    const unsigned int dst = static_cast<unsigned int>(__cvta_generic_to_shared(smem_dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

__device__ __forceinline__ void load_row8(const uint4* p, float (&v)[kVec]) { unpack_bf16x8(__ldg(p), v); }

// ---------------------------------------------------------------------------------------------
// v1: one kernel per derivation stage
// ---------------------------------------------------------------------------------------------
//
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

constexpr int kV1Threads = 256;

// Stage 1, forward statistics and router outputs (one block per token):
//   r_p, r_c, m_p = route(h_a), m_c = route(act), C = P m_p, k = Q m_c + 1.
template <int N>
__global__ void __launch_bounds__(kV1Threads) pc_v1_forward_stats(
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
__global__ void __launch_bounds__(kV1Threads) pc_v1_correction_grads(
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

// Router backward for one token, shared by stages 3 and 5: given gz (already in stats), writes
//   gx = r*gu - r^3 * x * <gu, x> / H,  gu = (R^T gz) * w / H     as an fp32 row.
template <int N>
__device__ __forceinline__ void v1_router_backward_row(
    const uint4* __restrict__ x, const uint4* __restrict__ R, const uint4* __restrict__ w,
    const float (&gz)[N], const float r, float* __restrict__ gx_row, const int hidden, float* scratch) {
    const int slices = hidden / kVec;
    const float inv_h = 1.0f / static_cast<float>(hidden);
    float dot[1] = {0.0f};  // <gu, x>
    for (int s = threadIdx.x; s < slices; s += blockDim.x) {
        float xv[kVec], wv[kVec], gxn[kVec] = {}, rv[kVec];
        load_row8(x + s, xv); load_row8(w + s, wv);
#pragma unroll
        for (int n = 0; n < N; ++n) {
            load_row8(R + static_cast<long long>(n) * slices + s, rv);
#pragma unroll
            for (int e = 0; e < kVec; ++e) gxn[e] += rv[e] * gz[n];
        }
#pragma unroll
        for (int e = 0; e < kVec; ++e) dot[0] += gxn[e] * wv[e] * inv_h * xv[e];
    }
    block_sum<1>(dot, scratch);
    const float coef = r * r * r * dot[0] * inv_h;
    for (int s = threadIdx.x; s < slices; s += blockDim.x) {
        float xv[kVec], wv[kVec], gxn[kVec] = {}, rv[kVec];
        load_row8(x + s, xv); load_row8(w + s, wv);
#pragma unroll
        for (int n = 0; n < N; ++n) {
            load_row8(R + static_cast<long long>(n) * slices + s, rv);
#pragma unroll
            for (int e = 0; e < kVec; ++e) gxn[e] += rv[e] * gz[n];
        }
#pragma unroll
        for (int e = 0; e < kVec; ++e) gx_row[s * kVec + e] = r * gxn[e] * wv[e] * inv_h - coef * xv[e];
    }
}

// Stage 3, correct-step router backward (one block per token): gz_c = (Q^T gk)(1 - m_c^2), gx_c.
template <int N>
__global__ void __launch_bounds__(kV1Threads) pc_v1_correct_router_bwd(
    const uint4* __restrict__ act, const unsigned short* __restrict__ Q, const uint4* __restrict__ R,
    const uint4* __restrict__ w, float* __restrict__ stats, float* __restrict__ gx_c,
    const int hidden, const long long tokens) {
    using S = TokenStats<N>;
    __shared__ float scratch[32];
    const int slices = hidden / kVec;
    const long long t = blockIdx.x;
    float* st = stats + t * S::size;
    float gz[N];
#pragma unroll
    for (int l = 0; l < N; ++l) {
        float gm = 0.0f;
#pragma unroll
        for (int i = 0; i < N; ++i) gm += bf16_lo(Q[i * N + l]) * st[S::gk + i];
        const float m = st[S::m_c + l];
        gz[l] = gm * (1.0f - m * m);
    }
    __syncthreads();  // every thread has read stats before thread 0 writes gz_c
    if (threadIdx.x == 0)
        for (int l = 0; l < N; ++l) st[S::gz_c + l] = gz[l];
    v1_router_backward_row<N>(act + t * slices, R, w, gz, st[S::r_c], gx_c + t * hidden, hidden, scratch);
}

// Stage 4, prediction-coefficient gradients (one block per token): dC_ij = <gpred_i, h_j>,
// gpred_i = g_i - [i==a] gd, gd = sum_i k_i g_i.
template <int N>
__global__ void __launch_bounds__(kV1Threads) pc_v1_prediction_grads(
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
#pragma unroll
        for (int i = 0; i < N; ++i) {
            load_row8(grad + (i * tokens + t) * slices + s, g[i]);
#pragma unroll
            for (int e = 0; e < kVec; ++e) gd[e] += k[i] * g[i][e];
        }
#pragma unroll
        for (int i = 0; i < N; ++i) {  // g now holds gpred (0/1 factor: `a` is a runtime value)
            const float is_a = (i == a) ? 1.0f : 0.0f;
#pragma unroll
            for (int e = 0; e < kVec; ++e) g[i][e] = fmaf(-is_a, gd[e], g[i][e]);
        }
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
__global__ void __launch_bounds__(kV1Threads) pc_v1_predict_router_bwd(
    const uint4* __restrict__ hs, const unsigned short* __restrict__ P, const uint4* __restrict__ R,
    const uint4* __restrict__ w, float* __restrict__ stats, float* __restrict__ gx_p,
    const int hidden, const long long tokens, const int a) {
    using S = TokenStats<N>;
    __shared__ float scratch[32];
    const int slices = hidden / kVec;
    const long long t = blockIdx.x;
    float* st = stats + t * S::size;
    float gz[N];
#pragma unroll
    for (int l = 0; l < N; ++l) {
        float gm = 0.0f;
#pragma unroll
        for (int q = 0; q < N * N; ++q) gm += bf16_lo(P[q * N + l]) * st[S::dC + q];
        const float m = st[S::m_p + l];
        gz[l] = gm * (1.0f - m * m);
    }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int l = 0; l < N; ++l) st[S::gz_p + l] = gz[l];
    v1_router_backward_row<N>(hs + (a * tokens + t) * slices, R, w, gz, st[S::r_p], gx_p + t * hidden,
                              hidden, scratch);
}

// Stage 6, element-wise gradients (one thread per 8-element slice of one token):
//   grad_h_j = gpred_j + sum_i C_ij gpred_i + [j==a] gx_p,  grad_act = gd + gx_c.
template <int N>
__global__ void __launch_bounds__(kV1Threads) pc_v1_elementwise(
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
#pragma unroll
    for (int i = 0; i < N; ++i) {
        load_row8(grad + i * tokens * slices + idx, gpred[i]);
        const float k = st[S::k + i];
#pragma unroll
        for (int e = 0; e < kVec; ++e) gd[e] += k * gpred[i][e];
    }
    // gpred_i = g_i - [i==a] gd. (`a` is a runtime value: a 0/1 factor, not `if (i == a)`, which
    // the compiler may turn into a runtime index into gpred and so into local memory.)
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const float is_a = (i == a) ? 1.0f : 0.0f;
#pragma unroll
        for (int e = 0; e < kVec; ++e) gpred[i][e] = fmaf(-is_a, gd[e], gpred[i][e]);
    }
    const float* gxp = gx_p + idx * kVec;
    const float* gxc = gx_c + idx * kVec;
#pragma unroll
    for (int j = 0; j < N; ++j) {
        float out[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
            float v = gpred[j][e];
#pragma unroll
            for (int i = 0; i < N; ++i) v += st[S::C + i * N + j] * gpred[i][e];
            out[e] = (j == a) ? v + gxp[e] : v;
        }
        grad_hs[j * tokens * slices + idx] = pack_bf16x8(out);
    }
    float out[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) out[e] = gd[e] + gxc[e];
    grad_act[idx] = pack_bf16x8(out);
}

// Stage 7a, router and norm weight gradients: block (x = slice group, y = token chunk) sums over
// its tokens in order and writes one partial row (layout of partial_stride):
//   dR[n] += gz_p[n] xn_p + gz_c[n] xn_c,  dw += (gxn_p u_p + gxn_c u_c) / H,  gxn = R^T gz.
template <int N>
__global__ void __launch_bounds__(kV1Threads) pc_v1_weight_grads(
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
//   dP[N*i+j][l] = sum_t dC_ij m_p_l   or   dQ[i][l] = sum_t gk_i m_c_l   over its tokens.
template <int N>
__global__ void __launch_bounds__(kV1Threads) pc_v1_coef_grads(
    const float* __restrict__ stats, float* __restrict__ partials, const int hidden,
    const long long tokens, const long long tokens_per_chunk) {
    using S = TokenStats<N>;
    __shared__ float scratch[32];
    const int entry = blockIdx.x;  // 0 .. N^3 + N^2 - 1
    int lhs, rhs;
    if (entry < N * N * N) { lhs = S::dC + entry / N; rhs = S::m_p + entry % N; }
    else { const int q = entry - N * N * N; lhs = S::gk + q / N; rhs = S::m_c + q % N; }
    const long long first = blockIdx.y * tokens_per_chunk;
    const long long last = min(tokens, first + tokens_per_chunk);
    float acc[1] = {0.0f};
    for (long long t = first + threadIdx.x; t < last; t += blockDim.x)
        acc[0] += stats[t * S::size + lhs] * stats[t * S::size + rhs];
    block_sum<1>(acc, scratch);
    if (threadIdx.x == 0)
        partials[blockIdx.y * partial_stride(N, hidden) + static_cast<long long>(N + 1) * hidden + entry] = acc[0];
}

// ---------------------------------------------------------------------------------------------
// v2: one fused pass
// ---------------------------------------------------------------------------------------------
//
// Grid: a persistent grid of G blocks; block b handles tokens b, b+G, b+2G, ... Thread x owns the
// 8-element slices x, x + blockDim.x, ..., x + (SLICES-1) * blockDim.x of every row.
// RESIDENT: the token's 2N+1 rows live in registers as packed bf16 (and the next token's rows are
// prefetched while this one is computed); router and norm weight slices stay in registers.
// Otherwise (large H) each phase re-reads its rows through L1/L2.
// Per-block partials (layout of partial_stride) are written once at the end.
// The active index A is a template parameter: every selection of stream A is then resolved at
// compile time (a runtime index into a register array would move the array to local memory).
// Weight-gradient accumulators live in dynamic shared memory (registers are for the rows): thread x
// owns the words [(q * kVec + e) * blockDim.x + x] for q = n * SLICES + c (dR_n, slice c) and
// q = N * SLICES + c (dw, slice c): consecutive threads, consecutive banks. Host: smem bytes =
// (N + 1) * SLICES * kVec * blockDim.x * 4.
// Launch bounds: 320 threads (one 8-element slice each: H <= 2560) keep the resident rows of
// N <= 3 within ptxas' 168-register cap; N = 4 needs the 255-register cap of 256 threads.
template <int N, bool RESIDENT>
struct V2Config {
    static constexpr int max_threads = (RESIDENT && N <= 3) ? 320 : 256;
};

template <int N, int A, int SLICES, bool RESIDENT>
__global__ void __launch_bounds__(V2Config<N, RESIDENT>::max_threads, 1)
pc_v2_fused(const uint4* __restrict__ grad, const uint4* __restrict__ hs, const uint4* __restrict__ act,
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

    // Router and norm weight slices (packed bf16), cached across tokens when resident.
    constexpr bool CACHE_RW = false;  // (registers are better spent on the rows; R and w hit L1)
    uint4 Rc[CACHE_RW ? N : 1][SLICES], wc[SLICES];
    if (CACHE_RW) {
#pragma unroll 1
        for (int c = 0; c < SLICES; ++c) {
            wc[c] = valid_of(c) ? __ldg(w + slice_of(c)) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int n = 0; n < (CACHE_RW ? N : 1); ++n)
                Rc[n][c] = valid_of(c) ? __ldg(R + n * slices_ll + slice_of(c)) : make_uint4(0, 0, 0, 0);
        }
    }
    auto load_R = [&](int n, int c) -> uint4 {
        if (CACHE_RW) return Rc[CACHE_RW ? n : 0][c];
        return valid_of(c) ? __ldg(R + n * slices_ll + slice_of(c)) : make_uint4(0, 0, 0, 0);
    };
    auto load_w = [&](int c) -> uint4 {
        if (CACHE_RW) return wc[c];
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

    auto row_ha = [&](long long t, int c, float (&v)[kVec]) { row(N + A, t, c, v); };

    // Per-block weight-gradient partials.
    auto acc = [&](int q, int e) -> float& { return acc_smem[(q * kVec + e) * blockDim.x + threadIdx.x]; };
#pragma unroll
    for (int q = 0; q < (N + 1) * SLICES; ++q)
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc(q, e) = 0.0f;
    float coef_acc = 0.0f;  // thread i < NCOEF owns entry i of dP | dQ
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
            row_ha(t, c, hv);
            row(2 * N, t, c, xv);
            unpack_bf16x8(load_w(c), wv);
#pragma unroll
            for (int e = 0; e < kVec; ++e) { r1[0] = fmaf(hv[e], hv[e], r1[0]); r1[1] = fmaf(xv[e], xv[e], r1[1]); }
#pragma unroll
            for (int n = 0; n < N; ++n) {
                float rv[kVec];
                unpack_bf16x8(load_R(n, c), rv);
#pragma unroll
                for (int e = 0; e < kVec; ++e) {
                    const float rw = rv[e] * wv[e];
                    r1[2 + n] = fmaf(rw, hv[e], r1[2 + n]);
                    r1[2 + N + n] = fmaf(rw, xv[e], r1[2 + N + n]);
                }
            }
        }
        block_sum<NR1>(r1, scratch);
        const float r_p = 1.0f / sqrtf(r1[0] * inv_h + eps), r_c = 1.0f / sqrtf(r1[1] * inv_h + eps);
        float m_p[N], m_c[N], C[N * N], k[N];
#pragma unroll
        for (int n = 0; n < N; ++n) {
            m_p[n] = tanhf(r1[2 + n] * r_p * inv_h);
            m_c[n] = tanhf(r1[2 + N + n] * r_c * inv_h);
        }
#pragma unroll
        for (int q = 0; q < N * N; ++q) {
            float s = 0.0f;
#pragma unroll
            for (int l = 0; l < N; ++l) s = fmaf(P[q * N + l], m_p[l], s);
            C[q] = s;
        }
#pragma unroll
        for (int i = 0; i < N; ++i) {
            float s = 1.0f;
#pragma unroll
            for (int l = 0; l < N; ++l) s = fmaf(Q[i * N + l], m_c[l], s);
            k[i] = s;
        }
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
#pragma unroll
            for (int e = 0; e < kVec; ++e) gd[e] = 0.0f;
#pragma unroll
            for (int i = 0; i < N; ++i) {
                row(i, t, c, g[i]);
#pragma unroll
                for (int e = 0; e < kVec; ++e) gd[e] = fmaf(k[i], g[i][e], gd[e]);
            }
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
        // gz_c = (Q^T gk)(1 - m_c^2), gz_p = (P^T dC)(1 - m_p^2)
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
            float hv[kVec], xv[kVec], wv[kVec];
            row_ha(t, c, hv);
            row(2 * N, t, c, xv);
            unpack_bf16x8(load_w(c), wv);
            float gxn_p[kVec], gxn_c[kVec];
#pragma unroll
            for (int e = 0; e < kVec; ++e) { gxn_p[e] = 0.0f; gxn_c[e] = 0.0f; }
#pragma unroll
            for (int n = 0; n < N; ++n) {
                float rv[kVec];
                unpack_bf16x8(load_R(n, c), rv);
#pragma unroll
                for (int e = 0; e < kVec; ++e) {
                    gxn_p[e] = fmaf(rv[e], gz_p[n], gxn_p[e]);
                    gxn_c[e] = fmaf(rv[e], gz_c[n], gxn_c[e]);
                }
            }
#pragma unroll
            for (int e = 0; e < kVec; ++e) {
                r3[0] = fmaf(gxn_p[e] * wv[e], hv[e], r3[0]);
                r3[1] = fmaf(gxn_c[e] * wv[e], xv[e], r3[1]);
            }
        }
        block_sum<2>(r3, scratch);  // its barriers also publish tok[] (written by thread 0 above)
        if (threadIdx.x < NCOEF) coef_acc = fmaf(tok[coef_lhs], tok[coef_rhs], coef_acc);
        // gx = r gu - r^3 x <gu, x> / H, with <gu, x> = r3 / H
        const float coef_p = r_p * r_p * r_p * r3[0] * inv_h * inv_h;
        const float coef_c = r_c * r_c * r_c * r3[1] * inv_h * inv_h;
        const float rp_h = r_p * inv_h, rc_h = r_c * inv_h;

        // ---- element-wise outputs and the weight-gradient partials
#pragma unroll 1
        for (int c = 0; c < SLICES; ++c) {
            float hv[kVec], xv[kVec], wv[kVec];
            row_ha(t, c, hv);
            row(2 * N, t, c, xv);
            unpack_bf16x8(load_w(c), wv);
            float gxn_p[kVec], gxn_c[kVec];
#pragma unroll
            for (int e = 0; e < kVec; ++e) { gxn_p[e] = 0.0f; gxn_c[e] = 0.0f; }
#pragma unroll
            for (int n = 0; n < N; ++n) {
                float rv[kVec];
                unpack_bf16x8(load_R(n, c), rv);
#pragma unroll
                for (int e = 0; e < kVec; ++e) {
                    gxn_p[e] = fmaf(rv[e], gz_p[n], gxn_p[e]);
                    gxn_c[e] = fmaf(rv[e], gz_c[n], gxn_c[e]);
                }
            }
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
#pragma unroll
                for (int e = 0; e < kVec; ++e) gd[e] = 0.0f;
#pragma unroll
                for (int i = 0; i < N; ++i) {
                    row(i, t, c, g[i]);
#pragma unroll
                    for (int e = 0; e < kVec; ++e) gd[e] = fmaf(k[i], g[i][e], gd[e]);
                }
#pragma unroll
                for (int i = 0; i < N; ++i)
                    if (i == a)
#pragma unroll
                        for (int e = 0; e < kVec; ++e) g[i][e] -= gd[e];  // gpred
                const long long out_slice = t * slices_ll + slice_of(c);
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    float o[kVec];
#pragma unroll
                    for (int e = 0; e < kVec; ++e) {
                        float v = g[j][e];
#pragma unroll
                        for (int i = 0; i < N; ++i) v = fmaf(C[i * N + j], g[i][e], v);
                        o[e] = (j == a) ? v + gx_p[e] : v;
                    }
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
        for (int n = 0; n < N; ++n) {
            float4* p = reinterpret_cast<float4*>(out + n * static_cast<long long>(hidden) + e0);
            const int q = n * SLICES + c;
            p[0] = make_float4(acc(q, 0), acc(q, 1), acc(q, 2), acc(q, 3));
            p[1] = make_float4(acc(q, 4), acc(q, 5), acc(q, 6), acc(q, 7));
        }
        float4* p = reinterpret_cast<float4*>(out + N * static_cast<long long>(hidden) + e0);
        const int q = N * SLICES + c;
        p[0] = make_float4(acc(q, 0), acc(q, 1), acc(q, 2), acc(q, 3));
        p[1] = make_float4(acc(q, 4), acc(q, 5), acc(q, 6), acc(q, 7));
    }
    if (threadIdx.x < NCOEF) out[static_cast<long long>(N + 1) * hidden + threadIdx.x] = coef_acc;
}

// ---------------------------------------------------------------------------------------------
// v3: one block reduction per token
// ---------------------------------------------------------------------------------------------
//
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
// faster on the H200 (results/nvidia-h200/NOTES.md).

template <int N>
struct V3Layout {
    // reduced values
    static constexpr int kSsA = 0, kSsC = 1, kAp = 2, kAc = 2 + N, kG = 2 + 2 * N, kGc = 2 + 2 * N + N * N;
    static constexpr int kValues = 2 + 3 * N + N * N;
    static constexpr int kValuesPow2 = next_pow2(kValues);
    // broadcast coefficients
    static constexpr int kB = 0, kK = N * N, kAlphaP = kK + N, kAlphaC = kAlphaP + N, kBetaP = kAlphaC + N,
                         kBetaC = kBetaP + 1, kSigmaP = kBetaC + 1, kSigmaC = kSigmaP + N;
    static constexpr int kCoefs = kSigmaC + N;
    // per-block coefficient-gradient entries: dP (N^3) then dQ (N^2), spread over warp 0's lanes (v3)
    static constexpr int kCoefGrads = N * N * N + N * N;
    static constexpr int kCoefGradsPerLane = (kCoefGrads + 31) / 32;
};

// The token's rows of one 8-element slice, packed bf16 (4 registers per row).
template <int N>
struct V3Rows {
    uint4 g[N];
    uint4 h[N];
    uint4 act;
};

// LAST_USE: read-once data is loaded evict-first; a first read that will be repeated (the
// non-resident pass 1) is loaded normally so that the second read hits L1.
template <int N, bool LAST_USE>
__device__ __forceinline__ void v3_load(V3Rows<N>& rows, const uint4* __restrict__ grad, const uint4* __restrict__ hs,
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
// token's contribution to the coefficient gradients owned by each lane.
template <int N, int A>
__device__ __forceinline__ void v3_token_scalars(const float* __restrict__ t, V3Scalars<N>& sc, float* __restrict__ coefs,
                                                 const float* __restrict__ P, const float* __restrict__ Q,
                                                 float inv_h, float eps, float (&coef_grads)[V3Layout<N>::kCoefGradsPerLane]) {
    using L = V3Layout<N>;
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
#pragma unroll
    for (int slot = 0; slot < L::kCoefGradsPerLane; ++slot) {
        const int e = slot * 32 + lane;
        if (e < N * N * N) coef_grads[slot] += sc.dC[e / N] * sc.m_p[e % N];
        else if (e < L::kCoefGrads) coef_grads[slot] += sc.gk[(e - N * N * N) / N] * sc.m_c[(e - N * N * N) % N];
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
// scalars and broadcast coefficients, and the coefficient matrices in fp32 (v4: V4Shared).
template <int N>
struct V3Shared {
    float scratch[V3Layout<N>::kValues][33];  // per-warp partial sums (+1: no bank conflicts)
    float totals[V3Layout<N>::kValues];
    float coefs[V3Layout<N>::kCoefs];
    V3Scalars<N> token_scalars;
    float P[N * N * N], Q[N * N];  // read by warp 0 for every token
};

// The coefficient matrices, bf16 -> fp32, into shared memory (sh.P, sh.Q); ends on a barrier.
template <int N, typename Shared>
__device__ __forceinline__ void v3_stage_coefficients(Shared& sh, const unsigned short* __restrict__ P,
                                                      const unsigned short* __restrict__ Q) {
    for (int i = threadIdx.x; i < N * N * N + N * N; i += blockDim.x) {
        const float value = __uint_as_float(static_cast<unsigned int>(i < N * N * N ? P[i] : Q[i - N * N * N]) << 16);
        if (i < N * N * N) sh.P[i] = value; else sh.Q[i - N * N * N] = value;
    }
    __syncthreads();
}

// R[n] * w of one slice in fp32 from the packed bf16 weights (the router statistics and both
// router backwards use only this product), computed where it is used.
template <int N>
struct V3RouterTimesNorm {
    uint4 rn[N], wn;
    __device__ __forceinline__ V3RouterTimesNorm(const uint4* __restrict__ router, const uint4* __restrict__ norm,
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
template <int N, int A, typename RouterTimesNorm>
__device__ __forceinline__ void v3_dot_products(const V3Rows<N>& r, const RouterTimesNorm& rw,
                                                float (&v)[V3Layout<N>::kValuesPow2]) {
    using L = V3Layout<N>;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
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
        for (int e = 0; e < kVec; ++e) {
            const float gi = bf16_at(r.g[i], e);
            v[L::kGc + i] = fmaf(gi, bf16_at(r.act, e), v[L::kGc + i]);
#pragma unroll
            for (int j = 0; j < N; ++j) v[L::kG + i * N + j] = fmaf(gi, bf16_at(r.h[j], e), v[L::kG + i * N + j]);
        }
    }
}

// One warp adds the per-warp sums of `warps` warps in a fixed order: lane l, value l.
template <int N, int COLUMNS>
__device__ __forceinline__ void v3_sum_warps(const float (&scratch)[V3Layout<N>::kValues][COLUMNS], float* __restrict__ totals,
                                             const int warps) {
    const int lane = threadIdx.x & 31;
    if (lane < V3Layout<N>::kValues) {
        float total = 0.0f;
        for (int w = 0; w < warps; ++w) total += scratch[lane][w];
        totals[lane] = total;
    }
}

// One block reduction of the token's dot products (each warp by a spread butterfly, lane l ending
// with value l, then warp 0 sums the warps in a fixed order), then warp 0's scalar phase. Ends on
// a barrier, with sh.coefs holding the token's broadcast coefficients.
template <int N, int A>
__device__ __forceinline__ void v3_reduce_token(float (&v)[V3Layout<N>::kValuesPow2], V3Shared<N>& sh, float inv_h,
                                                float eps, float (&coef_grads)[V3Layout<N>::kCoefGradsPerLane]) {
    using L = V3Layout<N>;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    {
        const float warp_total = warp_sum_spread<L::kValuesPow2>(v);
        if (lane < L::kValues) sh.scratch[lane][warp] = warp_total;
    }
    __syncthreads();
    if (warp == 0) {
        v3_sum_warps<N>(sh.scratch, sh.totals, warps);
        __syncwarp();
        v3_token_scalars<N, A>(sh.totals, sh.token_scalars, sh.coefs, sh.P, sh.Q, inv_h, eps, coef_grads);
    }
    __syncthreads();
}

// Pass 2, first part: the slice's S[n] += sigma_p[n] h_a + sigma_c[n] act (c: the token's
// broadcast coefficients, V3Layout). s(n, e): a reference to S[n] at element e of the slice
// (shared memory in v3, registers in v4).
template <int N, int A, typename SliceOfS>
__device__ __forceinline__ void v3_accumulate_s(const V3Rows<N>& r, const float* __restrict__ c, const SliceOfS& s) {
    using L = V3Layout<N>;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
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
template <int N, int A, typename RouterTimesNorm>
__device__ __forceinline__ void v3_output_slice(const V3Rows<N>& r, const RouterTimesNorm& rw, const float* __restrict__ c,
                                                uint4* __restrict__ grad_act_out, uint4* __restrict__ grad_hs_out,
                                                const long long stream_stride) {
    using L = V3Layout<N>;
    {  // grad_act = sum_l k_l g_l + (R w)^T alpha_c - beta_c act
        float out[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
            float gd = 0.0f;
#pragma unroll
            for (int n = 0; n < N; ++n) gd = fmaf(c[L::kK + n], bf16_at(r.g[n], e), gd);
            out[e] = gd + fmaf(-c[L::kBetaC], bf16_at(r.act, e), rw.dot(e, c + L::kAlphaC));
        }
        __stcs(grad_act_out, pack_bf16x8(out));
    }
    // grad_h_j = sum_l B_jl g_l (+ (R w)^T alpha_p - beta_p h_a): stream A first, right after
    // grad_act, so the R w products both use are not held across the other rows.
#pragma unroll
    for (int row = 0; row < N; ++row) {
        const int j = row == 0 ? A : (row <= A ? row - 1 : row);
        float out[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
            float acc = 0.0f;
            if (j == A) {
                acc = fmaf(-c[L::kBetaP], bf16_at(r.h[A], e), rw.dot(e, c + L::kAlphaP));
            }
#pragma unroll
            for (int l = 0; l < N; ++l) acc = fmaf(c[L::kB + j * N + l], bf16_at(r.g[l], e), acc);
            out[e] = acc;
        }
        __stcs(grad_hs_out + j * stream_stride, pack_bf16x8(out));
    }
}

// One slice of the block's router and norm-weight partials from its S (pc_reduce_partials'
// layout): dR[n,d] = w_d S[n,d] / H, dw[d] = sum_n R[n,d] S[n,d] / H.
template <int N>
__device__ __forceinline__ void v3_write_router_partials(float* __restrict__ part, const float (&s)[N][kVec],
                                                         const uint4* __restrict__ router, const uint4* __restrict__ norm,
                                                         const int slice, const int slices, const float inv_h) {
    const int hidden = slices * kVec;
    auto store8 = [&](float* row, const float (&x)[kVec]) {  // two 16-byte stores (rows stay aligned)
        float4* dst = reinterpret_cast<float4*>(row + slice * kVec);
        dst[0] = make_float4(x[0], x[1], x[2], x[3]);
        dst[1] = make_float4(x[4], x[5], x[6], x[7]);
    };
    float wn[kVec], dw[kVec] = {};
    unpack_bf16x8(__ldg(norm + slice), wn);
#pragma unroll
    for (int n = 0; n < N; ++n) {  // one row at a time: only its S, R and dR are live
        float rn[kVec], dR[kVec];
        unpack_bf16x8(__ldg(router + n * slices + slice), rn);
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
            dR[e] = wn[e] * s[n][e] * inv_h;
            dw[e] = fmaf(rn[e], s[n][e], dw[e]);
        }
        store8(part + n * hidden, dR);
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) dw[e] *= inv_h;
    store8(part + N * hidden, dw);
}

// Warp 0's lanes hold the block's coefficient-gradient partials (dP then dQ, lane-strided).
template <int N>
__device__ __forceinline__ void v3_write_coef_partials(float* __restrict__ part, const float (&coef_grads)[V3Layout<N>::kCoefGradsPerLane],
                                                       const int hidden) {
    using L = V3Layout<N>;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < L::kCoefGradsPerLane; ++i) {
        const int e = i * 32 + lane;
        if (e < L::kCoefGrads) part[(N + 1) * hidden + e] = coef_grads[i];
    }
}

template <int N, int A, int SLICES, int MIN_BLOCKS>
__global__ void __launch_bounds__(MIN_BLOCKS == 1 ? 512 : 320, MIN_BLOCKS) pc_v3_fused(
    const uint4* __restrict__ grad,      // [N, M, H] bf16
    const uint4* __restrict__ hs,        // [N, M, H] bf16
    const uint4* __restrict__ act,       // [M, H] bf16
    const unsigned short* __restrict__ P,  // [N*N, N] bf16
    const unsigned short* __restrict__ Q,  // [N, N] bf16
    const uint4* __restrict__ router,    // [N, H] bf16
    const uint4* __restrict__ norm,      // [H] bf16
    uint4* __restrict__ grad_hs,         // [N, M, H] bf16
    uint4* __restrict__ grad_act,        // [M, H] bf16
    float* __restrict__ partials,        // [gridDim.x, partial_stride(N, H)] fp32
    const int hidden, const long long tokens, const float eps) {
    using L = V3Layout<N>;
    extern __shared__ float S[];  // [N][SLICES][8][blockDim.x]: this block's S
    __shared__ V3Shared<N> sh;
    v3_stage_coefficients<N>(sh, P, Q);

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
    float coef_grads[L::kCoefGradsPerLane] = {};

    V3Rows<N> r;  // one 8-element slice of the token's rows
    for (long long token = blockIdx.x; token < tokens; token += gridDim.x) {
        const long long token_slice0 = token * slices;
        float v[L::kValuesPow2] = {};  // the values, then zeros up to a power of two
#pragma unroll 1  // one slice at a time: SLICES costs no registers
        for (int c = 0; c < SLICES; ++c) {
            const int slice = threadIdx.x + c * blockDim.x;
            if (slice >= slices) continue;
            v3_load<N, false>(r, grad, hs, act, token_slice0 + slice, stream_stride);
            v3_dot_products<N, A>(r, V3RouterTimesNorm<N>(router, norm, slice, slices), v);
        }
        v3_reduce_token<N, A>(v, sh, inv_h, eps, coef_grads);
#pragma unroll 1
        for (int c = 0; c < SLICES; ++c) {
            const int slice = threadIdx.x + c * blockDim.x;
            if (slice >= slices) continue;
            v3_load<N, true>(r, grad, hs, act, token_slice0 + slice, stream_stride);
            v3_accumulate_s<N, A>(r, sh.coefs, [&](int n, int e) -> float& { return s_at(n, c, e); });
            v3_output_slice<N, A>(r, V3RouterTimesNorm<N>(router, norm, slice, slices), sh.coefs, grad_act + token_slice0 + slice, grad_hs + token_slice0 + slice,
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
        v3_write_router_partials<N>(part, s, router, norm, slice, slices, inv_h);
    }
    if (threadIdx.x < 32) v3_write_coef_partials<N>(part, coef_grads, hidden);
}

// ---------------------------------------------------------------------------------------------
// v4: v3's arithmetic, fed by the bulk-copy engine, with the scalar phase on its own warp
// ---------------------------------------------------------------------------------------------
//
// Measured on v3 (results/nvidia-h200/NOTES.md): at one or two blocks per SM the SM issues an
// instruction only every ~3 cycles per scheduler, and about half of the warps' stall time is at
// the block barrier while warp 0 alone turns the token's totals into coefficients. v4 keeps v3's
// per-slice arithmetic and changes how the work is scheduled:
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
//    stays in registers. One slice per compute thread (H <= 2560), one block per SM.

constexpr int kV4MaxStages = 6;

__device__ __forceinline__ unsigned int shared_address(const void* p) {
    return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(unsigned long long* bar, unsigned int arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(arrivals) : "memory");
}

// Makes the barriers' initialisation visible to the copy engine (the async proxy).
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Arrive once and announce the bytes the phase's copies will deliver.
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(unsigned long long* bar, unsigned int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void mbarrier_wait_parity(unsigned long long* bar, unsigned int parity) {
    unsigned int done = 0;
    while (!done) {
        asm volatile(
            "{\n\t.reg .pred p;\n\t"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
            "selp.u32 %0, 1, 0, p;\n\t}"
            : "=r"(done)
            : "r"(shared_address(bar)), "r"(parity)
            : "memory");
    }
}

// A contiguous global -> shared copy by the bulk-copy engine (16-byte aligned, a multiple of 16
// bytes), counted against `bar`'s expected bytes.
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, unsigned int bytes,
                                                    unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(shared_address(dst)), "l"(src), "r"(bytes), "r"(shared_address(bar))
                 : "memory");
}

// The slice's rows from one stage ([2N+1][slices] uint4: g_0..g_{N-1}, h_0..h_{N-1}, act).
template <int N>
__device__ __forceinline__ void v4_read_rows(V3Rows<N>& r, const uint4* stage_slice, const int slices) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        r.g[i] = stage_slice[i * slices];
        r.h[i] = stage_slice[(N + i) * slices];
    }
    r.act = stage_slice[2 * N * slices];
}

// The slice's R * w in fp32, precomputed once per block: element e of slice x lives in float4
// plane 2n + e / 4 at index x (consecutive threads, consecutive 16-byte words: no bank conflicts).
// Each thread writes and reads only its own slice, so no barrier guards the planes.
template <int N>
struct V4RouterTimesNorm {
    const float4* planes;  // this thread's slice in plane 0
    int slices;
    __device__ __forceinline__ float operator()(const int n, const int e) const {
        const float4 q = planes[(2 * n + e / 4) * slices];
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


// v4's scalar phase: v3_token_scalars' arithmetic, in the same order, as straight-line code on
// tiny matrices held in registers: every lane of the scalar warp computes the same values (no
// divergence, no shared-memory round trips between steps), so the chain is short; it is the
// critical path of a token when a block has few tokens. The coefficient gradients dP | dQ
// accumulate in shared memory (lane 0). v3 keeps the lane-parallel form: its warp 0 has 96
// registers, and this one needs more for N = 4.
template <int N, int A>
__device__ __forceinline__ void v4_token_scalars(const float* __restrict__ t, float* __restrict__ coefs,
                                                 float* __restrict__ coef_grads, const float* __restrict__ P,
                                                 const float* __restrict__ Q, const float inv_h, const float eps) {
    using L = V3Layout<N>;
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
#pragma unroll
    for (int ij = 0; ij < N * N; ++ij) {
        float c = 0.0f;
#pragma unroll
        for (int l = 0; l < N; ++l) c = fmaf(P[ij * N + l], m_p[l], c);
        C[ij] = c;
    }
#pragma unroll
    for (int i = 0; i < N; ++i) {
        float kk = 1.0f;
#pragma unroll
        for (int l = 0; l < N; ++l) kk = fmaf(Q[i * N + l], m_c[l], kk);
        k[i] = kk;
    }
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
#pragma unroll
    for (int l = 0; l < N; ++l) {
        float gm = 0.0f;
#pragma unroll
        for (int i = 0; i < N; ++i) gm = fmaf(Q[i * N + l], gk[i], gm);
        gz_c[l] = gm * (1.0f - m_c[l] * m_c[l]);
        gm = 0.0f;
#pragma unroll
        for (int ij = 0; ij < N * N; ++ij) gm = fmaf(P[ij * N + l], dC[ij], gm);
        gz_p[l] = gm * (1.0f - m_p[l] * m_p[l]);
    }
    if ((threadIdx.x & 31) != 0) return;
    // coefficient gradients: dP[N*i+j][l] += dC_ij m_p[l], dQ[i][l] += gk_i m_c[l]
#pragma unroll
    for (int e = 0; e < N * N * N; ++e) coef_grads[e] += dC[e / N] * m_p[e % N];
#pragma unroll
    for (int e = 0; e < N * N; ++e) coef_grads[N * N * N + e] += gk[e / N] * m_c[e % N];
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

// The block's coefficient-gradient partials from shared memory to pc_reduce_partials' layout,
// by one warp.
template <int N>
__device__ __forceinline__ void v4_write_coef_partials(float* __restrict__ part, const float* __restrict__ coef_grads,
                                                       const int hidden) {
    __syncwarp();  // lane 0 wrote the accumulators
    for (int e = threadIdx.x & 31; e < V3Layout<N>::kCoefGrads; e += 32) part[(N + 1) * hidden + e] = coef_grads[e];
}

// A barrier over the whole block that the two warp roles reach from different code: bar.sync
// counts arriving threads, whatever instruction they arrive from, and orders their memory accesses.
__device__ __forceinline__ void block_barrier() { asm volatile("bar.sync 0;" ::: "memory"); }

// Static shared memory of v4: v3's, with the warp sums and coefficients double-buffered by token
// parity (the scalar warp works one token behind the compute warps).
template <int N>
struct V4Shared {
    float scratch[2][V3Layout<N>::kValues][17];  // per-compute-warp sums (<= 16 warps; odd: no bank conflicts)
    float totals[V3Layout<N>::kValues];
    float coefs[2][V3Layout<N>::kCoefs];
    float coef_grads[V3Layout<N>::kCoefGrads];  // the block's dP | dQ partials
    float P[N * N * N], Q[N * N];
};

// The host decides without a GPU whether a ring fits, from this bound on the static part.
static_assert(sizeof(V4Shared<4>) + kV4MaxStages * sizeof(unsigned long long) <= 6144,
              "predict_correct.py: V4_STATIC_SHARED_BOUND");

// Dynamic shared memory (host: v4_shared_bytes): `stages` stages of (2N+1) rows of H bf16, then
// the R * w planes, N * H fp32. Block: one compute thread per slice, rounded up to whole warps,
// plus the scalar warp: at most 11 warps (H <= 2560), so three warps share a scheduler's 16K
// registers and each thread may hold 128 (at 17 warps, for H = 4096, the cap would be 96 and S
// would spill).
constexpr int kV4MaxThreads = 352;

template <int N, int A>
__global__ void __launch_bounds__(kV4MaxThreads, 1) pc_v4_fused(
    const uint4* __restrict__ grad,      // [N, M, H] bf16
    const uint4* __restrict__ hs,        // [N, M, H] bf16
    const uint4* __restrict__ act,       // [M, H] bf16
    const unsigned short* __restrict__ P,  // [N*N, N] bf16
    const unsigned short* __restrict__ Q,  // [N, N] bf16
    const uint4* __restrict__ router,    // [N, H] bf16
    const uint4* __restrict__ norm,      // [H] bf16
    uint4* __restrict__ grad_hs,         // [N, M, H] bf16
    uint4* __restrict__ grad_act,        // [M, H] bf16
    float* __restrict__ partials,        // [gridDim.x, partial_stride(N, H)] fp32
    const int hidden, const long long tokens, const float eps, const int stages) {
    using L = V3Layout<N>;
    constexpr int kRows = 2 * N + 1;
    extern __shared__ __align__(16) uint4 ring[];
    __shared__ __align__(8) unsigned long long stage_full[kV4MaxStages];
    __shared__ V4Shared<N> sh;

    const int slices = hidden / kVec;
    const long long stream_stride = tokens * slices;  // in 16-byte slices; can pass 2^31
    const unsigned int row_bytes = static_cast<unsigned int>(slices) * 16u;
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
        uint4* dst = ring + static_cast<long long>(into) * kRows * slices;
        mbarrier_arrive_expect_bytes(&stage_full[into], kRows * row_bytes);
#pragma unroll
        for (int i = 0; i < N; ++i) {
            bulk_copy_to_shared(dst + i * slices, grad + i * stream_stride + token * slices, row_bytes, &stage_full[into]);
            bulk_copy_to_shared(dst + (N + i) * slices, hs + i * stream_stride + token * slices, row_bytes, &stage_full[into]);
        }
        bulk_copy_to_shared(dst + 2 * N * slices, act + token * slices, row_bytes, &stage_full[into]);
    };

    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) mbarrier_init(&stage_full[s], 1);
        fence_mbarrier_init();
    }
    for (int e = threadIdx.x; e < L::kCoefGrads; e += blockDim.x) sh.coef_grads[e] = 0.0f;
    __syncthreads();
    if (scalar_warp && lane == 0)
        for (int j = 0; j < stages && j < count; ++j) load_token(j, j);
    // While the first tokens arrive: P, Q and each compute thread's R * w.
    float4* planes = reinterpret_cast<float4*>(ring + static_cast<long long>(stages) * kRows * slices) + slice;
    const V4RouterTimesNorm<N> rw{planes, slices};
    if (owns_slice) {
        const V3RouterTimesNorm<N> from_weights(router, norm, slice, slices);
#pragma unroll
        for (int n = 0; n < N; ++n)
#pragma unroll
            for (int half = 0; half < 2; ++half)
                planes[(2 * n + half) * slices] = make_float4(from_weights(n, 4 * half), from_weights(n, 4 * half + 1),
                                                             from_weights(n, 4 * half + 2), from_weights(n, 4 * half + 3));
    }
    v3_stage_coefficients<N>(sh, P, Q);

    float* part = partials + blockIdx.x * partial_stride(N, hidden);
    if (scalar_warp) {
        int refill = 0;  // the stage that token j - 2 held
        for (long long j = 0; j <= count; ++j) {
            if (j >= 1) {  // token j - 1's warp sums were written before the last barrier
                const int parity = static_cast<int>((j - 1) & 1);
                v3_sum_warps<N>(sh.scratch[parity], sh.totals, compute_warps);
                __syncwarp();
                v4_token_scalars<N, A>(sh.totals, sh.coefs[parity], sh.coef_grads, sh.P, sh.Q, inv_h, eps);
            }
            block_barrier();
            // Past this barrier the compute warps are done with token j - 2 (its pass 2 ran
            // in step j - 1): its stage takes token j - 2 + stages.
            if (j >= 2) {
                if (lane == 0 && j - 2 + stages < count) load_token(j - 2 + stages, refill);
                if (++refill == stages) refill = 0;
            }
        }
        v4_write_coef_partials<N>(part, sh.coef_grads, hidden);
        return;
    }

    float s[N][kVec] = {};
    V3Rows<N> r;
    int stage = 0, previous = 0;  // the stages of tokens j and j - 1
    unsigned int phase = 0;       // the phase of `stage`'s barrier that token j completes
    for (long long j = 0; j <= count; ++j) {
        if (j < count) {  // pass 1 of token j
            mbarrier_wait_parity(&stage_full[stage], phase);
            float v[L::kValuesPow2] = {};
            if (owns_slice) {
                v4_read_rows<N>(r, ring + static_cast<long long>(stage) * kRows * slices + slice, slices);
                v3_dot_products<N, A>(r, rw, v);
            }
            const float warp_total = warp_sum_spread<L::kValuesPow2>(v);
            if (lane < L::kValues) sh.scratch[j & 1][lane][warp] = warp_total;
        }
        block_barrier();
        if (j >= 1 && owns_slice) {  // pass 2 of token j - 1, with the coefficients of the last step
            const long long token = blockIdx.x + (j - 1) * gridDim.x;
            const float* c = sh.coefs[(j - 1) & 1];
            v4_read_rows<N>(r, ring + static_cast<long long>(previous) * kRows * slices + slice, slices);
            v3_accumulate_s<N, A>(r, c, [&](int n, int e) -> float& { return s[n][e]; });
            v3_output_slice<N, A>(r, rw, c, grad_act + token * slices + slice, grad_hs + token * slices + slice,
                                  stream_stride);
        }
        previous = stage;
        if (++stage == stages) {
            stage = 0;
            phase ^= 1u;
        }
    }
    if (owns_slice) v3_write_router_partials<N>(part, s, router, norm, slice, slices, inv_h);
}
