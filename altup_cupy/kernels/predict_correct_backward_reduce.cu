// predict_correct_backward_reduce.cu: the fixed-order sum of the backward's per-block
// weight-gradient partials (docs/SPEC.md section 2), shared by every version.
//
// What this version changed:
//   reduce: 32 warps each sum every 32nd block's columns in four interleaved chains, then warp 0
//           adds the 32 warp sums in a fixed order (bitwise deterministic, no atomics); the
//           coefficient gradients in fp64 (weight_grad_partials.cuh says why). On Hopper it is a
//           programmatic dependent launch: its blocks are placed while the backward's last blocks
//           still run and wait (griddep_wait) for the partials, instead of launching after them.
#include "common.cuh"
#include "weight_grad_partials.cuh"

constexpr int kReduceWarps = ALTUP_REDUCE_THREADS / 32;

// Column `column` of the partial rows (Column: a float4 or one fp64 entry; row b at rows + b *
// stride), summed over the `blocks` rows by the whole block (lane l of every warp takes the same
// column; in_range false: past the last column, only the barrier). Warp w sums rows w, w + 32,
// w + 64, ... in four interleaved chains that keep loads in flight (the partials were just written
// and sit in L2, so what costs is latency); warp 0 adds the warps' sums (`shares`) in warp order
// and hands the total to store(column, total).
template <typename Column, typename Store>
__device__ __forceinline__ void sum_column(const Column* __restrict__ rows, const long long stride,
                                           const long long column, const bool in_range, const int blocks,
                                           Column (&shares)[kReduceWarps][32], const Store& store) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    Column s[4] = {};
    if (in_range) {
        int b = warp;
        for (; b + 3 * kReduceWarps < blocks; b += 4 * kReduceWarps) {
#pragma unroll
            for (int k = 0; k < 4; ++k) add_column(s[k], rows[(b + k * kReduceWarps) * stride + column]);
        }
        for (; b < blocks; b += kReduceWarps) add_column(s[0], rows[b * stride + column]);
    }
    add_column(s[0], s[1]);
    add_column(s[2], s[3]);
    add_column(s[0], s[2]);
    shares[warp][lane] = s[0];
    __syncthreads();
    if (warp != 0 || !in_range) return;
    Column total = {};
#pragma unroll
    for (int w = 0; w < kReduceWarps; ++w) add_column(total, shares[w][lane]);
    store(column, total);
}

// The partials' column sums over `blocks` rows into the four fp32 weight gradients. Blocks
// [0, fp32 blocks) take 32 float4 columns of the fp32 part each; the blocks after them take 32
// coefficient-gradient entries each, one fp64 entry a lane (host: _sources.reduce_blocks).
// Deterministic: a fixed summation order, no atomics. The fp64 path costs registers (up to 48 a
// thread instead of 32: one block of 1024 threads per SM instead of two), which matters only where
// the grid has more blocks than the GPU has SMs: on an H200 from H = 3304 at N = 4 (4168 at N = 3,
// 5592 at N = 2), shapes that only v1-v3 serve and no benchmark workload has.
template <int N>
__global__ void __launch_bounds__(ALTUP_REDUCE_THREADS) predict_correct_backward_reduce(
    const float* __restrict__ partials, const int blocks, const int hidden,
    float* __restrict__ grad_router,  // [N, H]
    float* __restrict__ grad_norm,    // [H]
    float* __restrict__ grad_pred,    // [N*N, N]
    float* __restrict__ grad_corr) {  // [N, N]
    __shared__ union {
        float4 fp32[kReduceWarps][32];
        double fp64[kReduceWarps][32];
    } shares;
    griddep_wait();  // the partials are the kernel ahead's output
    const long long stride = partial_stride(N, hidden);  // floats; a multiple of 4 (host: partial_stride)
    const long long fp32_end = fp32_columns<N>(hidden);
    const long long fp32_blocks = (fp32_end + 31) / 32;
    const long long lane = threadIdx.x & 31;
    const WeightGrads<N> grads{grad_router, grad_norm, grad_pred, grad_corr, hidden};
    if (blockIdx.x < fp32_blocks) {
        const long long e4 = blockIdx.x * 32LL + lane;
        sum_column(reinterpret_cast<const float4*>(partials), stride / 4, e4, e4 < fp32_end, blocks, shares.fp32,
                   [&](long long column, float4 sum) { grads.store(column, sum); });
    } else {
        const long long c = (blockIdx.x - fp32_blocks) * 32 + lane;
        sum_column(coef_grad_partials<N>(partials, hidden), stride / 2, c, c < coef_grad_entries(N), blocks,
                   shares.fp64,
                   [&](long long entry, double sum) { grads.store_coef_grad(static_cast<int>(entry), sum); });
    }
}
