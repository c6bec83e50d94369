// A token's rows staged in shared memory by cp.async, two tokens deep: the v2 backwards copy the
// next token's rows while they work on this one.
//
// Every thread copies its own 16-byte slice of each row and later reads only that slice, so
// waiting for its own copies (cp.async.wait_group) is all the ordering needed: no barrier guards
// the stages, and a stage is refilled only after the same thread has read it.
#pragma once
#include "cp_async.cuh"

// A stage of ROWS rows of one token, each H bf16 long, read at this thread's slice.
template <int ROWS>
struct StagedRows {
    RowSlice slice;
    const unsigned short* stage;
    int hidden;
    __device__ __forceinline__ void row(const int r, float (&out)[kVec]) const {
        if (slice.active) {
            unpack_bf16x8(*reinterpret_cast<const uint4*>(stage + static_cast<long long>(r) * hidden + slice.d0), out);
        } else {
            RowSlice::zeros(out);
        }
    }
};

// Copies this thread's slice of token t's rows into `stage` (row r from row_source(r) + t * H) as
// one commit group; every thread commits one group per token, also past the last token, so that
// "all but the newest group" always means "this token's rows".
template <int ROWS, typename RowSource>
__device__ __forceinline__ void stage_token_rows(unsigned short* stage, const RowSlice& slice,
                                                 const RowSource& row_source, const long long t,
                                                 const long long tokens, const int hidden) {
    if (slice.active && t < tokens) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            cp_async16(stage + static_cast<long long>(r) * hidden + slice.d0, row_source(r) + t * hidden + slice.d0);
        }
    }
    cp_async_commit();
}

// Walks this block's tokens (b, b + grid, ...), each one's rows staged while the token before it
// is worked on: visit(t, stage) sees token t's StagedRows<ROWS>. `stages` holds 2 * ROWS * H bf16.
// (Visit is a functor struct, not a lambda: NVRTC compiles lambdas in device code only as device
// functions by default, a build option away from failing.)
template <int ROWS, typename RowSource, typename Visit>
__device__ __forceinline__ void for_each_staged_token(unsigned short* stages, const RowSlice& slice,
                                                      const RowSource& row_source, const long long tokens,
                                                      const int hidden, const Visit& visit) {
    const long long stage_size = static_cast<long long>(ROWS) * hidden;
    stage_token_rows<ROWS>(stages, slice, row_source, blockIdx.x, tokens, hidden);
    int current = 0;
    for (long long t = blockIdx.x; t < tokens; t += gridDim.x) {
        stage_token_rows<ROWS>(stages + (1 - current) * stage_size, slice, row_source, t + gridDim.x, tokens, hidden);
        cp_async_wait_all_but_newest();  // token t's copies have landed
        visit(t, StagedRows<ROWS>{slice, stages + current * stage_size, hidden});
        current = 1 - current;
    }
}
