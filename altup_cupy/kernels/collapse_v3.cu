// collapse_v3.cu: the collapse (docs/SPEC.md section 1) on Hopper (sm_90a), v3. Host side:
// ops/collapse_hopper.py.
//
// What this version changed:
//   v3: the GEMM (collapse_gemm_sm90.cuh, mode kStoreYStats) also writes each row's sum of squares
//       per column tile from its fp32 accumulators (fixed order, no atomics), so
//       collapse_epilogue_v3 below needs no reduction over y_k and reads it once, streamed. It
//       applies when K is not split (M large enough to fill the GPU with output tiles); where K is
//       split, v3 runs v2's kernels.
#include "collapse_gemm_sm90.cuh"

// v3's epilogue: the projections' row statistics come from the GEMM (collapse_gemm_sm90<kStoreYStats>:
// one sum of squares per row and column tile, added here in column-tile order), so each y_k is
// read exactly once, streamed; only stream 0 needs a block reduction (its row is read twice, the
// second time from L1/L2). Same per-element math and order as collapse_epilogue_v1.
constexpr int kEpilogueV3MaxThreads = ALTUP_COLLAPSE_V3_EPILOGUE_MAX_THREADS;

template <int N>
__global__ void __launch_bounds__(kEpilogueV3MaxThreads) collapse_epilogue_v3(
    const uint4* __restrict__ stream0,     // [rows, H] bf16: hidden_states[0]
    const float4* __restrict__ projected,  // [N-1, rows, H] fp32
    const float* __restrict__ row_sumsq,   // [N-1, rows, col_tiles] fp32
    uint4* __restrict__ out,               // [rows, H] bf16
    const int hidden, const long long rows, const int col_tiles, const float eps) {
    __shared__ float scratch[32];
    const int slices = hidden / kVec;
    const long long row = blockIdx.x;
    const long long row_slice0 = row * slices;
    float target_sq[1] = {0.0f};
    for (int s = threadIdx.x; s < slices; s += blockDim.x) {
        float v[kVec];
        unpack_bf16x8(stream0[row_slice0 + s], v);
#pragma unroll
        for (int e = 0; e < kVec; ++e) target_sq[0] = fmaf(v[e], v[e], target_sq[0]);
    }
    block_sum<1>(target_sq, scratch);

    const float inv_hidden = 1.0f / static_cast<float>(hidden);
    const float inv_n = 1.0f / static_cast<float>(N);
    const float target = sqrtf(target_sq[0] * inv_hidden);
    float scale[N - 1];
#pragma unroll
    for (int k = 0; k < N - 1; ++k) {
        const float* partial = row_sumsq + (k * rows + row) * col_tiles;
        float sum_sq = 0.0f;
        for (int t = 0; t < col_tiles; ++t) sum_sq += partial[t];
        scale[k] = target / sqrtf(fmaxf(sum_sq * inv_hidden, eps)) * inv_n;
    }

    const long long projection_stride = rows * slices;  // in slices of kVec floats
    for (int s = threadIdx.x; s < slices; s += blockDim.x) {
        float result[kVec];
        unpack_bf16x8(stream0[row_slice0 + s], result);
#pragma unroll
        for (int e = 0; e < kVec; ++e) result[e] *= inv_n;
#pragma unroll
        for (int k = 0; k < N - 1; ++k) {
            const float4* p = projected + 2 * (k * projection_stride + row_slice0 + s);
            const float4 a = load_streaming(p), b = load_streaming(p + 1);
            const float y[kVec] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
            for (int e = 0; e < kVec; ++e) result[e] = fmaf(y[e], scale[k], result[e]);
        }
        out[row_slice0 + s] = pack_bf16x8(result);
    }
}
