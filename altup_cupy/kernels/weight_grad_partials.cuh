// weight_grad_partials.cuh: the per-block weight-gradient partials every backward version writes
// and predict_correct_backward_reduce sums.
#pragma once

// Per-block weight-gradient partial layout (floats): dR [N*H] | dw [H] | dP [N*N*N] | dQ [N*N].
__host__ __device__ constexpr long long partial_stride(int n, int hidden) {
    return static_cast<long long>(n + 1) * hidden + n * n * n + n * n;
}

// The host sizes the partials from the same layout (_sources.partial_stride): a drift fails here.
static_assert(partial_stride(2, 0) == ALTUP_PARTIAL_COEF_FLOATS_2, "_sources.partial_stride, N = 2");
static_assert(partial_stride(3, 0) == ALTUP_PARTIAL_COEF_FLOATS_3, "_sources.partial_stride, N = 3");
static_assert(partial_stride(4, 0) == ALTUP_PARTIAL_COEF_FLOATS_4, "_sources.partial_stride, N = 4");
