// predict_correct_backward_reduce.cu: the fixed-order sum of the backward's per-block
// weight-gradient partials (docs/SPEC.md section 2), shared by every version.
//
// What this version changed:
//   reduce: 32 warps each sum every 32nd block's float4 columns in four interleaved chains, then
//           warp 0 adds the 32 warp sums in a fixed order (bitwise deterministic, no atomics).
#include "common.cuh"
#include "weight_grad_partials.cuh"

// out[e] = the sum over blocks b of partials[b * stride + e], written to the four fp32 weight
// gradients. A block of ALTUP_REDUCE_THREADS (32 warps) takes 128 consecutive entries as 32
// float4 columns: warp y sums blocks y, y + 32, y + 64, ... (four interleaved chains keep loads in
// flight; the partials were just written and sit in L2, so what costs is latency), then warp 0
// adds the 32 warp sums in a fixed order. Deterministic: a fixed summation order, no atomics. The stride is a multiple of
// 4 floats for every supported N and H (host: partial_stride), so rows stay 16-byte aligned.
template <int N>
__global__ void __launch_bounds__(ALTUP_REDUCE_THREADS) predict_correct_backward_reduce(
    const float4* __restrict__ partials, const int blocks, const int hidden,
    float* __restrict__ grad_router,  // [N, H]
    float* __restrict__ grad_norm,    // [H]
    float* __restrict__ grad_pred,    // [N*N, N]
    float* __restrict__ grad_corr) {  // [N, N]
    constexpr int kGroups = ALTUP_REDUCE_THREADS / 32;
    __shared__ float4 sums[kGroups][32];
    const long long stride4 = partial_stride(N, hidden) / 4;
    const int col = threadIdx.x & 31, group = threadIdx.x >> 5;
    const long long e4 = static_cast<long long>(blockIdx.x) * 32 + col;
    float4 s[4] = {};
    if (e4 < stride4) {
        int b = group;
        for (; b + 3 * kGroups < blocks; b += 4 * kGroups) {
#pragma unroll
            for (int k = 0; k < 4; ++k) add_float4(s[k], partials[(b + k * kGroups) * stride4 + e4]);
        }
        for (; b < blocks; b += kGroups) add_float4(s[0], partials[b * stride4 + e4]);
    }
    add_float4(s[0], s[1]);
    add_float4(s[2], s[3]);
    add_float4(s[0], s[2]);
    sums[group][col] = s[0];
    __syncthreads();
    if (group != 0 || e4 >= stride4) return;
    float4 total = {};
#pragma unroll
    for (int g = 0; g < kGroups; ++g) add_float4(total, sums[g][col]);
    store_weight_grads<N>(e4, total, hidden, grad_router, grad_norm, grad_pred, grad_corr);
}
