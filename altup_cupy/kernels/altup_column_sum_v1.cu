// altup_column_sum_v1.cu: out[c] = sum over rows r of partials[r * stride + c], in a fixed order,
// so the weight gradients the Gemma 3n step backwards accumulate per block come out bitwise
// identical run after run (no atomics).
//
// A block of 32 x 32 threads takes 32 consecutive columns: thread (x, y) sums rows y, y + 32,
// y + 64, ... of column x (the partials were just written and sit in L2: what costs is latency,
// so 32 independent chains per column keep loads in flight); then row y = 0 adds the 32 chain sums
// in order 0 .. 31.
#include "common.cuh"

constexpr int kColumnSumGroups = 32;

__global__ void __launch_bounds__(32 * kColumnSumGroups) altup_column_sum_v1(
    const float* __restrict__ partials, const int rows, const long long stride, const long long columns,
    float* __restrict__ out) {
    __shared__ float chains[kColumnSumGroups][33];  // +1: no bank conflicts on the transposed read
    const int x = threadIdx.x & 31, y = threadIdx.x >> 5;
    const long long c = static_cast<long long>(blockIdx.x) * 32 + x;
    float s = 0.0f;
    if (c < columns) {
        for (int r = y; r < rows; r += kColumnSumGroups) s += partials[r * stride + c];
    }
    chains[y][x] = s;
    __syncthreads();
    if (y == 0 && c < columns) {
        float total = 0.0f;
#pragma unroll
        for (int g = 0; g < kColumnSumGroups; ++g) total += chains[g][x];
        out[c] = total;
    }
}
