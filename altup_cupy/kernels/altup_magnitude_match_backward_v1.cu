// altup_magnitude_match_backward_v1.cu: the magnitude match's backward (magnitude_match_grads.cuh
// has the math), the row part of the backward of Gemma 3n's expansion and collapse; the GEMMs
// around it run in cuBLAS.
//
// What this version is: one block per token, every row of the token unpacked in fp32 registers
// across the block reduction; every row read once, every output row written once.
#include "common.cuh"
#include "altup_rows.cuh"
#include "magnitude_match_grads.cuh"

template <int N, typename BaseGrad>
__global__ void __launch_bounds__(kRowThreadsMax) altup_magnitude_match_backward_v1(
    const unsigned short* __restrict__ grad,  // g_k at grad + k * grad_stream_stride + t * H, bf16
    const unsigned short* __restrict__ base,  // b [M, H] bf16
    const float* __restrict__ projected,      // p_k, fp32
    unsigned short* __restrict__ grad_projected,  // gp_k, bf16, the same layout as p_k
    BaseGrad* __restrict__ grad_base,             // [M, H]: fp32 (expansion) or bf16 (collapse)
    const long long grad_stream_stride, const float grad_scale, const long long proj_stride_k,
    const long long proj_stride_t, const int hidden, const float floor) {
    constexpr int kSums = 2 * N - 1;
    __shared__ float scratch[32 * kSums];
    const RowSlice slice(hidden);
    const long long t = blockIdx.x;
    const float inv_h = 1.0f / static_cast<float>(hidden);

    float b[kVec], g0[kVec], g[N - 1][kVec], p[N - 1][kVec], sums[kSums];
    slice.load(base + t * hidden, b);
    slice.load(grad + t * hidden, g0);
    sums[0] = dot8(b, b);
#pragma unroll
    for (int k = 0; k < N - 1; ++k) {
        if (grad_stream_stride != 0) {
            slice.load(grad + (k + 1) * grad_stream_stride + t * hidden, g[k]);
        } else {
#pragma unroll
            for (int e = 0; e < kVec; ++e) g[k][e] = g0[e];
        }
        slice.load(projected + k * proj_stride_k + t * proj_stride_t, p[k]);
        sums[1 + k] = dot8(p[k], p[k]);
        sums[N + k] = dot8(g[k], p[k]);
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
        for (int e = 0; e < kVec; ++e) out[e] = c.direct * g[k][e] - c.through_norm * p[k][e];
        slice.store(grad_projected + k * proj_stride_k + t * proj_stride_t, out);
    }
    // b / t is finite only for t > 0; a zero base row has no direction to scale (and no gradient
    // through t: every q_k is zero there).
    base_coef = target > 0.0f ? base_coef * inv_h / target : 0.0f;
#pragma unroll
    for (int e = 0; e < kVec; ++e) g0[e] = fmaf(base_coef, b[e], grad_scale * g0[e]);
    slice.store(grad_base + t * hidden, g0);
}
