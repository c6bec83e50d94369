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
// v4's helpers (scalar phase, shared layout, row reads); the kernel below is v4's with the new end.
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

// Column sum of `rows` partial rows (row r at rows_base + r * row_step, each stride4 float4), in
// row order per column: deterministic. One block does it alone, so what costs is L2 latency: each
// thread takes kColumns columns at a time (threadIdx.x + c * blockDim.x) and issues kBatch rows
// of loads for each before adding them (absent rows load as +0). Loads bypass L1 (__ldcg: other
// blocks wrote the rows). `store(e4, sum)` writes a column's sum.
template <typename Store>
__device__ __forceinline__ void v5_sum_rows(const float4* rows_base, const long long row_step, const int rows,
                                            const long long stride4, Store store) {
    constexpr int kBatch = 8, kColumns = 2;
    auto add = [](float4& s, const float4 x) { s.x += x.x; s.y += x.y; s.z += x.z; s.w += x.w; };
    for (long long first = threadIdx.x; first < stride4; first += kColumns * blockDim.x) {
        float4 sum[kColumns] = {};
        for (int r0 = 0; r0 < rows; r0 += kBatch) {
            float4 x[kColumns][kBatch];
#pragma unroll
            for (int c = 0; c < kColumns; ++c) {
                const long long e4 = first + c * blockDim.x;
#pragma unroll
                for (int k = 0; k < kBatch; ++k)
                    x[c][k] = e4 < stride4 && r0 + k < rows ? __ldcg(rows_base + (r0 + k) * row_step + e4)
                                                            : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
#pragma unroll
            for (int c = 0; c < kColumns; ++c)
#pragma unroll
                for (int k = 0; k < kBatch; ++k) add(sum[c], x[c][k]);
        }
#pragma unroll
        for (int c = 0; c < kColumns; ++c)
            if (first + c * blockDim.x < stride4) store(first + c * blockDim.x, sum[c]);
    }
}

// The cross-block sum, by every thread of every block after the block's partial row is written.
// tickets: [groups + 1] counters, zero between launches (groups per group counter, then one).
template <int N>
__device__ __forceinline__ void v5_reduce_partials(float* __restrict__ partials, unsigned int* __restrict__ tickets,
                                                   const int group_size, const int hidden,
                                                   float* __restrict__ grad_router, float* __restrict__ grad_norm,
                                                   float* __restrict__ grad_pred, float* __restrict__ grad_corr) {
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
    v5_sum_rows(group_row, stride4, members, stride4, [&](long long e4, float4 sum) { __stcg(group_row + e4, sum); });
    if (!v5_last_to_arrive(&tickets[groups], static_cast<unsigned int>(groups))) return;
    const long long nh = static_cast<long long>(N) * hidden;
    v5_sum_rows(rows, group_size * stride4, groups, stride4, [&](long long e4, float4 sum) {
        const float values[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const long long e = 4 * e4 + q;
            if (e < nh) grad_router[e] = values[q];
            else if (e < nh + hidden) grad_norm[e - nh] = values[q];
            else if (e < nh + hidden + N * N * N) grad_pred[e - nh - hidden] = values[q];
            else grad_corr[e - nh - hidden - N * N * N] = values[q];
        }
    });
}

template <int N, int A>
__global__ void __launch_bounds__(ALTUP_V4_MAX_THREADS, 1) predict_correct_backward_v5(
    const uint4* __restrict__ grad,      // [N, M, H] bf16
    const uint4* __restrict__ hs,        // [N, M, H] bf16
    const uint4* __restrict__ act,       // [M, H] bf16
    const unsigned short* __restrict__ P,  // [N*N, N] bf16
    const unsigned short* __restrict__ Q,  // [N, N] bf16
    const uint4* __restrict__ router,    // [N, H] bf16
    const uint4* __restrict__ norm,      // [H] bf16
    uint4* __restrict__ grad_hs,         // [N, M, H] bf16
    uint4* __restrict__ grad_act,        // [M, H] bf16
    float* __restrict__ partials,        // [gridDim.x, partial_stride(N, H)] fp32
    const int hidden, const long long tokens, const float eps, const int stages,
    unsigned int* __restrict__ tickets,  // [groups + 1], zero between launches
    const int group_size,                // blocks per first-level group
    float* __restrict__ grad_router, float* __restrict__ grad_norm,  // [N, H], [H] fp32
    float* __restrict__ grad_pred, float* __restrict__ grad_corr) {  // [N*N, N], [N, N] fp32
    using L = SliceLayout<N>;
    constexpr int kRows = 2 * N + 1;
    extern __shared__ __align__(16) uint4 ring[];
    __shared__ __align__(8) unsigned long long stage_full[ALTUP_V4_MAX_STAGES];
    __shared__ V4Shared<N> sh;

    const int slices = hidden / kVec;
    const long long stream_stride = tokens * slices;  // in 16-byte slices; can pass 2^31
    const unsigned int row_bytes = static_cast<unsigned int>(slices) * 16u;
    const float inv_h = 1.0f / static_cast<float>(hidden);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int compute_warps = static_cast<int>(blockDim.x >> 5) - 1;
    const bool scalar_warp = warp == compute_warps;
    const int slice = threadIdx.x;
    const bool owns_slice = !scalar_warp && slice < slices;
    // This block's tokens: blockIdx.x + j * gridDim.x for j < count (count >= 1: grid <= tokens).
    const long long count = (tokens - blockIdx.x + gridDim.x - 1) / gridDim.x;

    // The block's j-th token into stage `into` (the scalar warp's lane 0 only).
    auto load_token = [&](long long j, int into) {
        const long long token = blockIdx.x + j * gridDim.x;
        uint4* dst = ring + static_cast<long long>(into) * kRows * slices;
        mbarrier_arrive_expect_bytes(&stage_full[into], kRows * row_bytes);
#pragma unroll
        for (int i = 0; i < N; ++i) {
            bulk_copy_to_shared(dst + i * slices, grad + i * stream_stride + token * slices, row_bytes, &stage_full[into]);
            bulk_copy_to_shared(dst + (N + i) * slices, hs + i * stream_stride + token * slices, row_bytes, &stage_full[into]);
        }
        bulk_copy_to_shared(dst + 2 * N * slices, act + token * slices, row_bytes, &stage_full[into]);
    };

    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) mbarrier_init(&stage_full[s], 1);
        fence_mbarrier_init();
    }
    for (int e = threadIdx.x; e < L::kCoefGrads; e += blockDim.x) sh.coef_grads[e] = 0.0f;
    __syncthreads();
    if (scalar_warp && lane == 0)
        for (int j = 0; j < stages && j < count; ++j) load_token(j, j);
    // While the first tokens arrive: P, Q and each compute thread's R * w.
    float4* planes = reinterpret_cast<float4*>(ring + static_cast<long long>(stages) * kRows * slices) + slice;
    const V4RouterTimesNorm<N> rw{planes, slices};
    if (owns_slice) {
        const RouterTimesNormFromWeights<N> from_weights(router, norm, slice, slices);
#pragma unroll
        for (int n = 0; n < N; ++n)
#pragma unroll
            for (int half = 0; half < 2; ++half)
                planes[(2 * n + half) * slices] = make_float4(from_weights(n, 4 * half), from_weights(n, 4 * half + 1),
                                                             from_weights(n, 4 * half + 2), from_weights(n, 4 * half + 3));
    }
    stage_coefficients<N>(sh, P, Q);

    float* part = partials + blockIdx.x * partial_stride(N, hidden);
    if (scalar_warp) {
        int refill = 0;  // the stage that token j - 2 held
        for (long long j = 0; j <= count; ++j) {
            if (j >= 1) {  // token j - 1's warp sums were written before the last barrier
                const int parity = static_cast<int>((j - 1) & 1);
                sum_warp_totals<N>(sh.scratch[parity], sh.totals, compute_warps);
                __syncwarp();
                v4_token_scalars<N, A>(sh.totals, sh.coefs[parity], sh.coef_grads, sh.P, sh.Q, inv_h, eps);
            }
            block_barrier();
            // Past this barrier the compute warps are done with token j - 2 (its pass 2 ran
            // in step j - 1): its stage takes token j - 2 + stages.
            if (j >= 2) {
                if (lane == 0 && j - 2 + stages < count) load_token(j - 2 + stages, refill);
                if (++refill == stages) refill = 0;
            }
        }
        v4_write_coef_partials<N>(part, sh.coef_grads, hidden);
    } else {
        float s[N][kVec] = {};
        SliceRows<N> r;
        int stage = 0, previous = 0;  // the stages of tokens j and j - 1
        unsigned int phase = 0;       // the phase of `stage`'s barrier that token j completes
        for (long long j = 0; j <= count; ++j) {
            if (j < count) {  // pass 1 of token j
                mbarrier_wait_parity(&stage_full[stage], phase);
                float v[L::kValuesPow2] = {};
                if (owns_slice) {
                    v4_read_rows<N>(r, ring + static_cast<long long>(stage) * kRows * slices + slice, slices);
                    slice_dot_products<N, A>(r, rw, v);
                }
                const float warp_total = warp_sum_spread<L::kValuesPow2>(v);
                if (lane < L::kValues) sh.scratch[j & 1][lane][warp] = warp_total;
            }
            block_barrier();
            if (j >= 1 && owns_slice) {  // pass 2 of token j - 1, with the coefficients of the last step
                const long long token = blockIdx.x + (j - 1) * gridDim.x;
                const float* c = sh.coefs[(j - 1) & 1];
                v4_read_rows<N>(r, ring + static_cast<long long>(previous) * kRows * slices + slice, slices);
                slice_accumulate_s<N, A>(r, c, [&](int n, int e) -> float& { return s[n][e]; });
                slice_output<N, A>(r, rw, c, grad_act + token * slices + slice, grad_hs + token * slices + slice,
                                      stream_stride);
            }
            previous = stage;
            if (++stage == stages) {
                stage = 0;
                phase ^= 1u;
            }
        }
        if (owns_slice) slice_write_router_partials<N>(part, s, router, norm, slice, slices, inv_h);
    }
    v5_reduce_partials<N>(partials, tickets, group_size, hidden, grad_router, grad_norm, grad_pred, grad_corr);
}
