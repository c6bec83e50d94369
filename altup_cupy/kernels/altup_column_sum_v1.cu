// altup_column_sum_v1.cu: out[c] = sum over rows r of partials[r * stride + c], r in increasing
// order, one thread per column: a fixed summation order, no atomics, so the weight gradients the
// Gemma 3n step backwards accumulate per block come out bitwise identical run after run.
#include "common.cuh"

__global__ void __launch_bounds__(256) altup_column_sum_v1(
    const float* __restrict__ partials, const int rows, const long long stride, const long long columns,
    float* __restrict__ out) {
    const long long c = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c >= columns) return;
    // four independent chains keep loads in flight; they are combined in a fixed order
    float s[4] = {};
    int r = 0;
    for (; r + 3 < rows; r += 4) {
#pragma unroll
        for (int k = 0; k < 4; ++k) s[k] += partials[(r + k) * stride + c];
    }
    for (; r < rows; ++r) s[0] += partials[r * stride + c];
    out[c] = (s[0] + s[1]) + (s[2] + s[3]);
}
