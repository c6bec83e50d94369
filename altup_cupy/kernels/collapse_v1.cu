// collapse_v1.cu: the AltUp collapse forward (docs/SPEC.md section 1), epilogue side.
//
// The projections y_k = x_k @ W_k^T come from cuBLAS (bf16 in, fp32 out; see the host module).
// What is left per row t is memory-bound:
//     target = sqrt(mean(s0^2)),  mag_k = sqrt(max(mean(y_k^2), eps))
//     out    = (s0 + sum_k y_k * target / mag_k) / N      -> bf16
//
// Versions (one line each on what changed):
//   collapse_epilogue_v1: one block per row; each thread keeps CHUNKS 16-byte slices of s0 and
//                         of every y_k in registers, so the row is read from memory exactly once
//                         (up to H = 8192) and all N statistics come out of one block reduction.
//                         On Hopper a programmatic dependent launch: it is launched once the GEMM
//                         ahead releases it (at the latest as that GEMM's blocks exit, which
//                         saves the gap between two launches) and waits (griddep_wait) for its output.
#include "common.cuh"

// Threads per block that still leave each thread the registers for CHUNKS slices of N streams
// (65536 registers per SM): the tiers of _sources.COLLAPSE_LAUNCH_BOUNDS (the host picks launch
// shapes from the same table).
__host__ __device__ constexpr int collapse_max_threads(int n, int chunks) {
    return n * chunks <= ALTUP_COLLAPSE_SLICES_0   ? ALTUP_COLLAPSE_THREADS_0
           : n * chunks <= ALTUP_COLLAPSE_SLICES_1 ? ALTUP_COLLAPSE_THREADS_1
                                                   : ALTUP_COLLAPSE_THREADS_2;
}

// Load one sweep of CHUNKS slices per thread (slices past the row end read as zeros).
template <int N, int CHUNKS>
__device__ __forceinline__ void collapse_load_sweep(
    const uint4* __restrict__ stream0, const float4* __restrict__ projected, long long row_slice0,
    long long projection_stride, int first_slice, int slices,
    float (&s0)[CHUNKS][kVec], float (&y)[N - 1][CHUNKS][kVec]) {
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const int slice = first_slice + threadIdx.x + c * blockDim.x;
        if (slice < slices) {
            unpack_bf16x8(load_streaming(stream0 + row_slice0 + slice), s0[c]);
#pragma unroll
            for (int k = 0; k < N - 1; ++k) {
                const float4* p = projected + 2 * (k * projection_stride + row_slice0 + slice);
                const float4 a = load_streaming(p), b = load_streaming(p + 1);
                y[k][c][0] = a.x; y[k][c][1] = a.y; y[k][c][2] = a.z; y[k][c][3] = a.w;
                y[k][c][4] = b.x; y[k][c][5] = b.y; y[k][c][6] = b.z; y[k][c][7] = b.w;
            }
        } else {
#pragma unroll
            for (int e = 0; e < kVec; ++e) {
                s0[c][e] = 0.0f;
#pragma unroll
                for (int k = 0; k < N - 1; ++k) y[k][c][e] = 0.0f;
            }
        }
    }
}

// N streams (N-1 projections), CHUNKS slices of kVec elements per thread per sweep. When the
// row fits in one sweep (H / kVec <= CHUNKS * blockDim.x, every shape up to H = 8192) it stays
// in registers between the statistics and the output; wider rows are read a second time.
template <int N, int CHUNKS>
__global__ void __launch_bounds__(collapse_max_threads(N, CHUNKS)) collapse_epilogue_v1(
    const uint4* __restrict__ stream0,      // [rows, H] bf16: hidden_states[0] for these rows
    const float4* __restrict__ projected,   // [N-1, rows, H] fp32: the cuBLAS outputs
    uint4* __restrict__ out,                // [rows, H] bf16
    const int hidden,                       // H, divisible by kVec
    const long long rows,
    const float eps) {
    static_assert(N * CHUNKS <= ALTUP_COLLAPSE_SLICES_2, "no launch-bounds tier of _sources holds N * CHUNKS slices");
    __shared__ float scratch[32 * N];
    const int slices = hidden / kVec;
    const int sweep = CHUNKS * blockDim.x;
    const bool one_sweep = slices <= sweep;
    const long long row_slice0 = static_cast<long long>(blockIdx.x) * slices;  // can pass 2^31
    const long long projection_stride = rows * slices;  // in slices of kVec floats

    float s0[CHUNKS][kVec];
    float y[N - 1][CHUNKS][kVec];
    float sum_sq[N];
#pragma unroll
    for (int k = 0; k < N; ++k) sum_sq[k] = 0.0f;

    griddep_wait();  // the projections are the GEMM's output (and stream 0 is older than the GEMM)
    for (int first = 0; first < slices; first += sweep) {
        collapse_load_sweep<N, CHUNKS>(stream0, projected, row_slice0, projection_stride, first,
                                       slices, s0, y);
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
            for (int e = 0; e < kVec; ++e) {
                sum_sq[0] = fmaf(s0[c][e], s0[c][e], sum_sq[0]);
#pragma unroll
                for (int k = 0; k < N - 1; ++k) sum_sq[k + 1] = fmaf(y[k][c][e], y[k][c][e], sum_sq[k + 1]);
            }
    }
    block_sum<N>(sum_sq, scratch);

    // Fold target / mag_k and the final 1/N into one scale per stream.
    const float inv_hidden = 1.0f / static_cast<float>(hidden);
    const float inv_n = 1.0f / static_cast<float>(N);
    const float target = sqrtf(sum_sq[0] * inv_hidden);
    float scale[N - 1];
#pragma unroll
    for (int k = 0; k < N - 1; ++k)
        scale[k] = target / sqrtf(fmaxf(sum_sq[k + 1] * inv_hidden, eps)) * inv_n;

    for (int first = 0; first < slices; first += sweep) {
        if (!one_sweep)
            collapse_load_sweep<N, CHUNKS>(stream0, projected, row_slice0, projection_stride, first,
                                           slices, s0, y);
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const int slice = first + threadIdx.x + c * blockDim.x;
            if (slice < slices) {
                float result[kVec];
#pragma unroll
                for (int e = 0; e < kVec; ++e) {
                    float acc = s0[c][e] * inv_n;
#pragma unroll
                    for (int k = 0; k < N - 1; ++k) acc = fmaf(y[k][c][e], scale[k], acc);
                    result[e] = acc;
                }
                out[row_slice0 + slice] = pack_bf16x8(result);
            }
        }
    }
}
