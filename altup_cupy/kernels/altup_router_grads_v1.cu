// altup_router_grads_v1.cu: the weight gradients of Gemma 3n's AltUp predict and correct backward,
// finished in one launch from the per-block partials the backward kernels write.
//
//   S[n][d]  = sum_b partials[b][n * H + d]        coef[c] = sum_b partials[b][N * H + c]
//   grad R[n][d] = s w[d] S[n][d]     grad w[d] = s sum_n R[n][d] S[n][d]     grad coef[c] = coef[c]
//
// (s: the router's input scale; R, w: the router and router-norm weights.) Every sum runs in a
// fixed order, so the gradients are bitwise identical run after run (no atomics), and each is
// rounded once, to bf16, the weights' dtype. What this kernel replaced: a plain column sum of the
// partials followed by seven small torch ops for grad R and grad w and three fp32 -> bf16
// conversions, ten launches and their host cost per backward call.
//
// A block of 32 x 32 threads takes 32 consecutive columns. Thread (x, y) sums rows y, y + 32,
// y + 64, ... of its column (the partials were just written and sit in L2: what costs is latency,
// so 32 independent chains per column keep loads in flight); then row y = 0 adds the 32 chain sums
// in order 0 .. 31. Blocks [0, ceil(H / 32)) take hidden columns d, all N streams of each, so the
// thread that holds S[0..N-1][d] also finishes grad R[.][d] and grad w[d]; the blocks after them
// take the coefficient columns.
#include "common.cuh"

constexpr int kRouterGradChains = 32;

__device__ __forceinline__ float bf16_value(const unsigned short bits) {
    return __uint_as_float(static_cast<unsigned int>(bits) << 16);
}

__device__ __forceinline__ unsigned short rounded_bf16(const float x) {
    return static_cast<unsigned short>(pack_bf16x2(x, 0.0f) & 0xffffu);
}

template <int N>
__global__ void __launch_bounds__(32 * kRouterGradChains) altup_router_grads_v1(
    const float* __restrict__ partials, const int rows, const long long stride, const int hidden,
    const int coef_columns, const unsigned short* __restrict__ router_weight,  // [N, H] bf16
    const unsigned short* __restrict__ norm_weight,                            // [H] bf16
    const float router_scale,
    unsigned short* __restrict__ grad_coefs,   // [coef_columns] bf16
    unsigned short* __restrict__ grad_router,  // [N, H] bf16
    unsigned short* __restrict__ grad_norm) {  // [H] bf16
    // +1 column: the transposed read of row y = 0 hits 32 different banks
    __shared__ float chains[N][kRouterGradChains][33];
    const int x = threadIdx.x & 31, y = threadIdx.x >> 5;
    const int hidden_blocks = (hidden + 31) / 32;
    const bool takes_hidden = static_cast<int>(blockIdx.x) < hidden_blocks;
    const int column = takes_hidden ? blockIdx.x * 32 + x : (blockIdx.x - hidden_blocks) * 32 + x;
    const bool active = column < (takes_hidden ? hidden : coef_columns);
    // The first float of this thread's column in partial row 0; stream n of a hidden column sits
    // n * H floats further on.
    const float* first = partials + (takes_hidden ? column : static_cast<long long>(N) * hidden + column);
    const int streams = takes_hidden ? N : 1;

    float sums[N];
#pragma unroll
    for (int n = 0; n < N; ++n) sums[n] = 0.0f;
    if (active) {
        for (int r = y; r < rows; r += kRouterGradChains) {
            const float* row = first + static_cast<long long>(r) * stride;
#pragma unroll
            for (int n = 0; n < N; ++n) {
                if (n < streams) sums[n] += row[static_cast<long long>(n) * hidden];
            }
        }
    }
#pragma unroll
    for (int n = 0; n < N; ++n) chains[n][y][x] = sums[n];
    __syncthreads();
    if (y != 0 || !active) return;

#pragma unroll
    for (int n = 0; n < N; ++n) {
        float total = 0.0f;
#pragma unroll
        for (int g = 0; g < kRouterGradChains; ++g) total += chains[n][g][x];
        sums[n] = total;
    }
    if (!takes_hidden) {
        grad_coefs[column] = rounded_bf16(sums[0]);
        return;
    }
    const float scaled_norm = router_scale * bf16_value(norm_weight[column]);
    float router_dot = 0.0f;  // sum_n R[n][d] S[n][d], in stream order
#pragma unroll
    for (int n = 0; n < N; ++n) {
        const long long at = static_cast<long long>(n) * hidden + column;
        grad_router[at] = rounded_bf16(scaled_norm * sums[n]);
        router_dot = fmaf(bf16_value(router_weight[at]), sums[n], router_dot);
    }
    grad_norm[column] = rounded_bf16(router_scale * router_dot);
}
