// altup_correct_backward_v3.cu: the correct step's backward (altup_correct_backward.cuh), version 3.
//
// What this version changed: v2's weight sums, with the token's rows packed in registers and the
// block's next token's rows loaded while it works on this one (PrefetchedRows below). v2 holds the
// token's N + 2 rows unpacked (8 (N + 2) floats) and issues their loads only when the token's turn
// comes, so between its last store and its next loads' arrival a block has no read in flight.
// Packed (4 registers a row, as loaded), this token's rows and the next one's take what v2's rows
// took; the next token's loads are issued as this token's rows are taken and used one iteration
// later, and the row of grad_active is added then too, so that no instruction waits on a load
// issued for the next token. Unpacking is exact and the products and their order are v2's: the
// same bits.
#include "altup_correct_backward.cuh"

template <int N, int A, bool kActive>
struct PrefetchedRows {
    // A token's rows packed as loaded, and its row of grad_active (where kActive), added when taken.
    struct Loaded {
        uint4 g[N], x, pred_a, active_g;
        __device__ __forceinline__ void load(const RowSlice& slice, const CorrectTokenRows& rows, const long long t) {
#pragma unroll
            for (int i = 0; i < N; ++i) g[i] = slice.load_packed(rows.g(t, i));
            if (kActive) active_g = slice.load_packed(rows.active_g(t));
            x = slice.load_packed(rows.x(t));
            pred_a = slice.load_packed(rows.pred_a(t, A));
        }
    };
    using Ahead = RowsAhead<Loaded, CorrectTokenRows>;

    uint4 rows_g[N], row_x, row_pred_a;
    // Token t's rows, loaded one iteration earlier; then the loads of the block's token after t.
    __device__ __forceinline__ PrefetchedRows(const RowSlice&, const CorrectTokenRows&, const long long t,
                                              Ahead& ahead) {
#pragma unroll
        for (int i = 0; i < N; ++i) rows_g[i] = ahead.next.g[i];
        if (kActive) rows_g[A] = add_bf16x8(rows_g[A], ahead.next.active_g);
        row_x = ahead.next.x;
        row_pred_a = ahead.next.pred_a;
        ahead.load(t + gridDim.x);
    }
    __device__ __forceinline__ void g(const int i, float (&out)[kVec]) const { unpack_bf16x8(rows_g[i], out); }
    __device__ __forceinline__ void x(float (&out)[kVec]) const { unpack_bf16x8(row_x, out); }
    __device__ __forceinline__ void pred_a(float (&out)[kVec]) const { unpack_bf16x8(row_pred_a, out); }
};

template <int N, int A, bool kActive>
__global__ void ROUTED_BACKWARD_BOUNDS altup_correct_backward_v3(CORRECT_BACKWARD_PARAMS) {
    correct_backward<N, A, kActive, SliceMajorSums, PrefetchedRows>(CORRECT_BACKWARD_ARGS);
}
