// altup_expand_forward_v1.cu: the row epilogue after the projection GEMMs of Gemma 3n's stream
// expansion (the model's input; the GEMMs run in cuBLAS): the magnitude match
// (magnitude_match_grads.cuh has its math) with the embeddings as the base row,
//   streams = (b, q_1 .. q_{N-1}),  q_k = p_k t / n_k.
// One block per token; every row read once, every output row written once. The fp32 projections
// p_k: element (k, t, d) at k * proj_stride_k + t * proj_stride_t + d.
#include "common.cuh"
#include "altup_rows.cuh"

template <int N>
__global__ void __launch_bounds__(kRowThreadsMax) altup_expand_forward_v1(
    const unsigned short* __restrict__ embeddings,  // [M, H] bf16
    const float* __restrict__ projected,            // p_k, fp32, layout above
    unsigned short* __restrict__ streams,           // [N, M, H] bf16
    const long long proj_stride_k, const long long proj_stride_t, const long long tokens,
    const int hidden, const float floor) {
    __shared__ float scratch[32 * N];
    const RowSlice slice(hidden);
    const long long t = blockIdx.x, plane = tokens * hidden;
    const float inv_h = 1.0f / static_cast<float>(hidden);

    float b[kVec], p[N - 1][kVec], sums[N];
    slice.load(embeddings + t * hidden, b);
    sums[0] = dot8(b, b);
#pragma unroll
    for (int k = 0; k < N - 1; ++k) {
        slice.load(projected + k * proj_stride_k + t * proj_stride_t, p[k]);
        sums[1 + k] = dot8(p[k], p[k]);
    }
    block_sum(sums, scratch);
    const float target = sqrtf(sums[0] * inv_h);
    slice.store(streams + t * hidden, b);
#pragma unroll
    for (int k = 0; k < N - 1; ++k) {
        const float scale = target / sqrtf(fmaxf(sums[1 + k] * inv_h, floor));
#pragma unroll
        for (int e = 0; e < kVec; ++e) p[k][e] *= scale;
        slice.store(streams + (k + 1) * plane + t * hidden, p[k]);
    }
}
