// collapse_v5.cu: the AltUp collapse forward (docs/SPEC.md section 1), epilogue side of v5; v1's
// math and order (collapse_v1.cu). Host side: ops/collapse_versions.py.
//
// What this version changed:
//   v5: the host runs v1's GEMMs and epilogue in row blocks whose fp32 projections fit in L2, so
//       the epilogue reads them from L2 right after the GEMMs wrote them. Once a block's threads
//       have all read a row's projections for the last time, collapse_epilogue_v5 drops their
//       lines from L2 without writing them back (discard.global.L2, sm_80+): they are dead, and
//       a dirty line evicted later would cost a write to HBM that nothing reads.
// v1's source: the kernel below runs v1's two halves of a row and the discard between or after them.
#include "collapse_v1.cu"

// Drop the row's N-1 projections from L2 without write-back. Only lines wholly inside the row:
// when H * 4 bytes is no multiple of the line, the row shares its first and last line with its
// neighbours, which other blocks still read. Thread i drops lines i, i + blockDim.x, ... of each
// projection. The caller guarantees that every thread of the block has read the row for the last
// time; the memory clobber keeps the compiler from moving loads past the discard.
template <int N>
__device__ __forceinline__ void collapse_discard_projections(const float4* projected, const CollapseRow& row) {
    constexpr unsigned long long kLineBytes = ALTUP_L2_LINE_BYTES;
    constexpr unsigned long long kSliceBytes = kVec * sizeof(float);
#pragma unroll
    for (int k = 0; k < N - 1; ++k) {
        const float4* row_start = projected + 2 * (k * row.projection_stride + row.slice0);
        const unsigned long long begin = __cvta_generic_to_global(row_start);
        const unsigned long long end = begin + row.slices * kSliceBytes;
        const unsigned long long first_line = (begin + kLineBytes - 1) / kLineBytes * kLineBytes;
        for (unsigned long long line = first_line + threadIdx.x * kLineBytes; line + kLineBytes <= end;
             line += blockDim.x * kLineBytes)
            asm volatile("discard.global.L2 [%0], %1;" ::"l"(line), "n"(kLineBytes) : "memory");
    }
}

// v1's epilogue (same arguments, same launch shape) with the row's projections discarded after
// their last read: in one sweep that is the statistics pass, which ends with every thread holding
// the block's totals, so every thread has read its part; a row wider than one sweep is read again
// by the output pass, so its discard waits for a barrier after that pass.
template <int N, int CHUNKS>
__global__ void __launch_bounds__(collapse_max_threads(N, CHUNKS)) collapse_epilogue_v5(
    const uint4* __restrict__ stream0,      // [rows, H] bf16: hidden_states[0] for these rows
    const float4* __restrict__ projected,   // [N-1, rows, H] fp32: this row block's cuBLAS outputs
    uint4* __restrict__ out,                // [rows, H] bf16
    const int hidden,                       // H, divisible by kVec
    const long long rows,
    const float eps) {
    __shared__ float scratch[32 * N];
    const CollapseRow row = collapse_row<CHUNKS>(hidden, rows);
    float s0[CHUNKS][kVec];
    float y[N - 1][CHUNKS][kVec];
    float scale[N - 1];
    collapse_row_scales<N, CHUNKS>(stream0, projected, row, hidden, eps, scratch, s0, y, scale);
    if (row.one_sweep) collapse_discard_projections<N>(projected, row);
    collapse_write_row<N, CHUNKS>(stream0, projected, out, row, s0, y, scale);
    if (!row.one_sweep) {
        __syncthreads();
        collapse_discard_projections<N>(projected, row);
    }
}
