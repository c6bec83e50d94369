// altup_magnitude_match_backward_v2.cu: the magnitude match's backward (the expansion's and the
// collapse's; magnitude_match_grads.cuh has the math, altup_magnitude_match_backward_v1.cu the
// arguments), with more tokens in flight per SM.
//
// What this version changed: v1 holds every row of its token unpacked in fp32 registers across
// the block reduction (the base row, N upstream gradients and N-1 projections: 8 N + 8 (N-1)
// floats a thread) and needs 90 registers at N = 4, so two blocks of 256 threads (H = 2048)
// share an SM: two tokens in flight, each block idle at its barrier while it waits on its loads.
// v2 keeps the bf16 rows packed (4 registers a row, as loaded) and unpacks an element where it is
// used; the fp32 projections stay as they are: 74 registers at N = 4 (sm_90), three blocks of 256
// threads an SM. (Capped at 64 registers for four blocks, it spills 36 bytes.) Unpacking is exact
// and every sum and product is the one v1 forms, in v1's order: v2 gives v1's bits.
#include "common.cuh"
#include "altup_rows.cuh"
#include "magnitude_match_grads.cuh"

// sum_e bf16(x)[e] y[e] in v1's order (dot8 of the unpacked row).
__device__ __forceinline__ float dot8_packed(const uint4& x, const float (&y)[kVec]) {
    float s = 0.0f;
#pragma unroll
    for (int e = 0; e < kVec; ++e) s = fmaf(bf16_at(x, e), y[e], s);
    return s;
}

template <int N, typename BaseGrad>
__global__ void __launch_bounds__(kRowThreadsMax) altup_magnitude_match_backward_v2(
    const unsigned short* __restrict__ grad, const unsigned short* __restrict__ base,
    const float* __restrict__ projected, unsigned short* __restrict__ grad_projected,
    BaseGrad* __restrict__ grad_base, const long long grad_stream_stride, const float grad_scale,
    const long long proj_stride_k, const long long proj_stride_t, const int hidden, const float floor) {
    constexpr int kSums = 2 * N - 1;
    __shared__ float scratch[32 * kSums];
    const RowSlice slice(hidden);
    const long long t = blockIdx.x;
    const float inv_h = 1.0f / static_cast<float>(hidden);

    const uint4 b = slice.load_packed(base + t * hidden), g0 = slice.load_packed(grad + t * hidden);
    uint4 g[N - 1];
    float p[N - 1][kVec], sums[kSums];
    {
        float unpacked[kVec];
        unpack_bf16x8(b, unpacked);
        sums[0] = dot8(unpacked, unpacked);
    }
#pragma unroll
    for (int k = 0; k < N - 1; ++k) {
        g[k] = grad_stream_stride != 0 ? slice.load_packed(grad + (k + 1) * grad_stream_stride + t * hidden) : g0;
        slice.load(projected + k * proj_stride_k + t * proj_stride_t, p[k]);
        sums[1 + k] = dot8(p[k], p[k]);
        sums[N + k] = dot8_packed(g[k], p[k]);
    }
    block_sum(sums, scratch);
    const float target = sqrtf(sums[0] * inv_h);
    float base_coef = 0.0f;
#pragma unroll
    for (int k = 0; k < N - 1; ++k) {
        const MatchGradScalars c(sums[1 + k], sums[N + k], target, grad_scale, inv_h, floor);
        base_coef += c.base_term;
        float out[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) out[e] = c.direct * bf16_at(g[k], e) - c.through_norm * p[k][e];
        slice.store(grad_projected + k * proj_stride_k + t * proj_stride_t, out);
    }
    // as v1: a zero base row has no direction to scale
    base_coef = target > 0.0f ? base_coef * inv_h / target : 0.0f;
    float out[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) out[e] = fmaf(base_coef, bf16_at(b, e), grad_scale * bf16_at(g0, e));
    slice.store(grad_base + t * hidden, out);
}
