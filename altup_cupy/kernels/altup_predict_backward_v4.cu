// altup_predict_backward_v4.cu: the predict step's backward (altup_predict_backward.cuh), version 4.
//
// What this version changed: a block loads its next token's rows while it works on this one.
// v3 issues a token's loads only when the token's turn comes, so between its last store and its
// next loads' arrival a block has no read in flight, and at two blocks an SM (the register cap) the
// memory is busy only part of the time. v4 keeps v3's packed rows and, as it takes a token's rows,
// issues the loads of the block's next token into a second set of registers (PrefetchedRows below:
// 8 N more, under the same cap at N = 4 on sm_90 without spills), used one iteration later. The row
// of grad_active is added when the rows are taken, not when they are loaded, so that no
// instruction waits on a load issued for the next token. The same products in the same order as
// v3: the same bits. (A version that staged the next token in shared memory by cp.async measured
// slower than v3: the staging cost shared-memory traffic and barriers that registers do not.)
#include "altup_predict_backward.cuh"

template <int N, int A, bool kActive>
struct PrefetchedRows {
    // A token's rows packed as loaded, and its row of grad_active (where kActive), added when taken.
    struct Loaded {
        uint4 h[N], g[N], active_g;
        __device__ __forceinline__ void load(const RowSlice& slice, const TokenRows& rows, const long long t) {
#pragma unroll
            for (int j = 0; j < N; ++j) {
                h[j] = slice.load_packed(rows.h(t, j));
                g[j] = slice.load_packed(rows.g(t, j));
            }
            if (kActive) active_g = slice.load_packed(rows.active_g(t));
        }
    };
    using Ahead = RowsAhead<Loaded, TokenRows>;

    uint4 rows_h[N], rows_g[N];
    // Token t's rows, loaded one iteration earlier; then the loads of the block's token after t.
    __device__ __forceinline__ PrefetchedRows(const RowSlice&, const TokenRows&, const long long t, Ahead& ahead) {
#pragma unroll
        for (int j = 0; j < N; ++j) {
            rows_h[j] = ahead.next.h[j];
            rows_g[j] = ahead.next.g[j];
        }
        if (kActive) rows_g[A] = add_bf16x8(rows_g[A], ahead.next.active_g);
        ahead.load(t + gridDim.x);
    }
    __device__ __forceinline__ void h(const int j, float (&out)[kVec]) const { unpack_bf16x8(rows_h[j], out); }
    __device__ __forceinline__ void g(const int i, float (&out)[kVec]) const { unpack_bf16x8(rows_g[i], out); }
};

template <int N, int A, bool kActive>
__global__ void ROUTED_BACKWARD_BOUNDS altup_predict_backward_v4(PREDICT_BACKWARD_PARAMS) {
    predict_backward<N, A, kActive, SliceMajorSums, PrefetchedRows>(PREDICT_BACKWARD_ARGS);
}
