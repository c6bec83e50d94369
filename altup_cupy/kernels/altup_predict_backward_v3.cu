// altup_predict_backward_v3.cu: the predict step's backward (altup_predict_backward.cuh), version 3.
//
// What this version changed: the token's rows of h and of g stay packed in registers as loaded
// (PackedRows, below), so g is read from memory once instead of once per use.
#include "altup_predict_backward.cuh"

// Both sets of rows stay packed as loaded, 4 registers a row: 8 N registers hold all 2N rows
// (v1 and v2 spend 8 N on h alone), so g is read once, straight from memory, and unpacked (exactly)
// where it is used.
template <int N, int A, bool kActive>
struct PackedRows {
    using Ahead = NothingAhead;
    uint4 rows_h[N], rows_g[N];
    __device__ __forceinline__ PackedRows(const RowSlice& slice, const TokenRows& rows, const long long t, Ahead&) {
#pragma unroll
        for (int j = 0; j < N; ++j) {
            rows_h[j] = slice.load_packed(rows.h(t, j));
            rows_g[j] = slice.load_packed(rows.g(t, j));
        }
        if (kActive) rows_g[A] = add_bf16x8(rows_g[A], slice.load_packed(rows.active_g(t)));
    }
    __device__ __forceinline__ void h(const int j, float (&out)[kVec]) const { unpack_bf16x8(rows_h[j], out); }
    __device__ __forceinline__ void g(const int i, float (&out)[kVec]) const { unpack_bf16x8(rows_g[i], out); }
};

template <int N, int A, bool kActive>
__global__ void ROUTED_BACKWARD_BOUNDS altup_predict_backward_v3(PREDICT_BACKWARD_PARAMS) {
    predict_backward<N, A, kActive, SliceMajorSums, PackedRows>(PREDICT_BACKWARD_ARGS);
}
