// collapse_v2.cu: the collapse (docs/SPEC.md section 1) on Hopper (sm_90a), v2: the projections by
// the package's own GEMM (collapse_gemm_sm90.cuh, mode kStoreY), then v1's epilogue
// (collapse_v1.cu) on the fp32 y_k. Host side: ops/collapse_hopper.py.
//
// What this version changed:
//   v2: the projections by this package's GEMM in place of cuBLAS (TMA, wgmma, producer and
//       consumer warpgroups, a persistent grid). When the output tiles alone cannot fill the GPU
//       (small M), K is split so that every SM streams its share of the weights, and
//       collapse_split_sum below adds the splits' fp32 partials in a fixed order.
#include "collapse_gemm_sm90.cuh"

// y = sum over s of partials[s] in the order s = 0, 1, ...: the K splits' partials combined
// deterministically. Counts in float4 (H is a multiple of 8, so every slab is).
__global__ void collapse_split_sum(const float4* __restrict__ partials, float4* __restrict__ y,
                                   const int splits, const long long count) {
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < count;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        float4 acc = partials[i];
        for (int s = 1; s < splits; ++s) {
            const float4 v = partials[s * count + i];
            acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
        }
        y[i] = acc;
    }
}
