// weight_grad_partials.cuh: the per-block weight-gradient partials every backward version writes
// and predict_correct_backward_reduce (or v5's in-kernel sum) adds up.
#pragma once

// Per-block weight-gradient partial layout (floats): dR [N*H] | dw [H] | dP [N*N*N] | dQ [N*N].
__host__ __device__ constexpr long long partial_stride(int n, int hidden) {
    return static_cast<long long>(n + 1) * hidden + n * n * n + n * n;
}

// The host sizes the partials from the same layout (_sources.partial_stride): a drift fails here.
static_assert(partial_stride(2, 0) == ALTUP_PARTIAL_COEF_FLOATS_2, "_sources.partial_stride, N = 2");
static_assert(partial_stride(3, 0) == ALTUP_PARTIAL_COEF_FLOATS_3, "_sources.partial_stride, N = 3");
static_assert(partial_stride(4, 0) == ALTUP_PARTIAL_COEF_FLOATS_4, "_sources.partial_stride, N = 4");

__device__ __forceinline__ void add_float4(float4& sum, const float4 x) {
    sum.x += x.x; sum.y += x.y; sum.z += x.z; sum.w += x.w;
}

// Entry e4 (4 floats) of the partials' column sums into the four fp32 weight gradients: the
// layout's dR, dw, dP and dQ parts ([N, H], [H], [N*N, N], [N, N]).
template <int N>
__device__ __forceinline__ void store_weight_grads(const long long e4, const float4 sum, const int hidden,
                                                   float* __restrict__ grad_router, float* __restrict__ grad_norm,
                                                   float* __restrict__ grad_pred, float* __restrict__ grad_corr) {
    const float values[4] = {sum.x, sum.y, sum.z, sum.w};
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
