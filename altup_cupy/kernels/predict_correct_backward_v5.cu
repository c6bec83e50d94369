// predict_correct_backward_v5.cu: the backward of AltUp's predict + correct step (docs/SPEC.md
// section 2), v4 with the weight gradients' cross-block sum inside the kernel (sm_90 only);
// notation of predict_correct_backward_v1.cu.
//
// What this version changed:
//   v5: no second launch. Every block writes its partial row as v4 does, then takes a ticket in
//       its group of blocks; the last block of a group sums the group's rows in block order into
//       the group's first row, then takes a ticket among the groups; the last group sums the group
//       rows in group order into the four fp32 weight gradients. Fixed orders only: bitwise
//       deterministic. Each last block resets its counter to 0 for the next launch.
// v4's source: the kernel below runs v4's block (v4_block_backward), then the cross-block sum.
#include "predict_correct_backward_v4.cu"

// Two levels (groups of about sqrt(blocks) blocks) keep the rows that one block sums serially to
// about 2 sqrt(blocks): one block alone reading every partial row (132 rows of 41 KiB at N = 4,
// H = 2048) would take longer than the separate reduction kernel.

// Whether this block is the last of `expected` to arrive at `counter`; the last one resets it
// (the next launch on the stream starts from 0). The fences order every thread's partial writes
// before the ticket (release) and the last block's reads after it (acquire).
__device__ __forceinline__ bool v5_last_to_arrive(unsigned int* counter, const unsigned int expected) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int arrived = atomicAdd(counter, 1u) + 1u;
        last = arrived == expected;
        if (arrived == expected) *counter = 0u;
    }
    __syncthreads();
    if (!last) return false;
    __threadfence();
    return true;
}

// Column sums of `rows` partial rows (row r at rows_base + r * row_step, in 16-byte columns) over
// the columns [begin, end), all of one kind (Column: float4 or double2), in row order per column:
// deterministic. One block does it alone, so what costs is L2 latency: each thread takes kColumns
// columns at a time (threadIdx.x + c * blockDim.x) and issues kBatch rows of loads for each
// before adding them (absent rows load as +0). Loads bypass L1 (__ldcg: other blocks wrote the
// rows). `store(e4, sum)` writes a column's sum.
template <typename Column, typename Store>
__device__ __forceinline__ void v5_sum_rows(const Column* rows_base, const long long row_step, const int rows,
                                            const long long begin, const long long end, Store store) {
    constexpr int kBatch = 8, kColumns = 2;
    for (long long first = begin + threadIdx.x; first < end; first += kColumns * blockDim.x) {
        Column sum[kColumns] = {};
        for (int r0 = 0; r0 < rows; r0 += kBatch) {
            Column x[kColumns][kBatch];
#pragma unroll
            for (int c = 0; c < kColumns; ++c) {
                const long long e4 = first + c * blockDim.x;
#pragma unroll
                for (int k = 0; k < kBatch; ++k)
                    x[c][k] = e4 < end && r0 + k < rows ? __ldcg(rows_base + (r0 + k) * row_step + e4) : Column{};
            }
#pragma unroll
            for (int c = 0; c < kColumns; ++c)
#pragma unroll
                for (int k = 0; k < kBatch; ++k) add_column(sum[c], x[c][k]);
        }
#pragma unroll
        for (int c = 0; c < kColumns; ++c)
            if (first + c * blockDim.x < end) store(first + c * blockDim.x, sum[c]);
    }
}

// v5_sum_rows over every column of the partial rows: the router and norm-weight columns in fp32
// (float4), the coefficient-gradient columns in fp64 (double2; weight_grad_partials.cuh says why).
// `store(e4, sum)` takes either kind.
template <int N, typename Store>
__device__ __forceinline__ void v5_sum_partial_rows(const float4* rows_base, const long long row_step, const int rows,
                                                    const int hidden, Store store) {
    const long long fp32_end = fp32_columns<N>(hidden), end = partial_stride(N, hidden) / 4;
    v5_sum_rows(rows_base, row_step, rows, 0, fp32_end, store);
    v5_sum_rows(reinterpret_cast<const double2*>(rows_base), row_step, rows, fp32_end, end, store);
}

// The cross-block sum, by every thread of every block after the block's partial row is written.
// tickets: [groups + 1] counters, zero between launches (groups per group counter, then one).
template <int N>
__device__ __forceinline__ void v5_reduce_partials(float* __restrict__ partials, unsigned int* __restrict__ tickets,
                                                   const int group_size, const int hidden, const WeightGrads<N> grads) {
    const long long stride4 = partial_stride(N, hidden) / 4;
    const int blocks = static_cast<int>(gridDim.x);
    const int groups = (blocks + group_size - 1) / group_size;
    const int group = static_cast<int>(blockIdx.x) / group_size;
    const int first = group * group_size;
    const int members = min(group_size, blocks - first);
    float4* rows = reinterpret_cast<float4*>(partials);
    if (!v5_last_to_arrive(&tickets[group], static_cast<unsigned int>(members))) return;
    // The group's rows, in block order, into the group's first row (only this block touches
    // them now: every member has arrived).
    float4* group_row = rows + first * stride4;
    v5_sum_partial_rows<N>(group_row, stride4, members, hidden, [&](long long e4, auto sum) {
        __stcg(reinterpret_cast<decltype(sum)*>(group_row) + e4, sum);
    });
    if (!v5_last_to_arrive(&tickets[groups], static_cast<unsigned int>(groups))) return;
    v5_sum_partial_rows<N>(rows, group_size * stride4, groups, hidden,
                           [&](long long e4, auto sum) { grads.store(e4, sum); });
}

template <int N, int A>
__global__ void __launch_bounds__(ALTUP_V4_MAX_THREADS, 1) predict_correct_backward_v5(
    SINGLE_PASS_BACKWARD_PARAMETERS, const int stages,
    unsigned int* __restrict__ tickets,  // [groups + 1], zero between launches
    const int group_size,                // blocks per first-level group
    float* __restrict__ grad_router, float* __restrict__ grad_norm,  // [N, H], [H] fp32
    float* __restrict__ grad_pred, float* __restrict__ grad_corr) {  // [N*N, N], [N, N] fp32
    v4_block_backward<N, A>(grad, hs, act, P, Q, router, norm, grad_hs, grad_act, partials, hidden, tokens, eps, stages);
    v5_reduce_partials<N>(partials, tickets, group_size, hidden, {grad_router, grad_norm, grad_pred, grad_corr, hidden});
}
