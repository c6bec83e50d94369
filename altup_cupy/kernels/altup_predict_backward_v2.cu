// altup_predict_backward_v2.cu: Gemma 3n's AltUp predict backward, v1's arithmetic with the next
// token's rows in flight while the block works on this one.
//
// What this version changed: v1 loads a token's 2N rows (h and g) when it starts on the token, so
// each token begins with a full memory latency that nothing overlaps but the SM's other block; the
// profile of v1 shows a latency chain per token, not bandwidth (2.9x its copy floor at M = 8192).
// Here every thread copies its own 16-byte slice of the next token's 2N rows into shared memory
// with cp.async (global -> shared, no registers) before it starts on this token, two stages deep
// (staged_rows.cuh), and reads this token's rows from the stage that arrived.
//
// Dynamic shared memory: S (N * H fp32, as v1) then 2 stages of 2N bf16 rows: 8 N H bytes more than
// v1 (64 KB at N = 4, H = 2048). The host picks v1 where that does not fit the device.
#include "altup_predict_v1.cu"
#include "staged_rows.cuh"

// Row r of a token's stage: h_r for r < N, then g_{r-N} (token 0's rows; the stager adds t * H).
template <int N>
struct PredictRowSource {
    const unsigned short* hidden_states;
    const unsigned short* grad_predictions;
    long long plane;
    __device__ __forceinline__ const unsigned short* operator()(const int r) const {
        return r < N ? hidden_states + r * plane : grad_predictions + (r - N) * plane;
    }
};

// The token rows predict_backward_token reads, from a stage laid out as PredictRowSource.
template <int N>
struct StagedPredictRows {
    StagedRows<2 * N> stage;
    __device__ __forceinline__ void h(const int j, float (&out)[kVec]) const { stage.row(j, out); }
    __device__ __forceinline__ void g(const int i, float (&out)[kVec]) const { stage.row(N + i, out); }
};

template <int N, int A>
struct PredictBackwardVisit {
    const RowSlice& slice;
    const RouterSlice<N>& router;
    PredictBackwardState<N>& state;
    unsigned short* grad_hidden_states;
    long long plane;
    int hidden;
    float eps, router_scale;
    __device__ __forceinline__ void operator()(const long long t, const StagedRows<2 * N>& stage) const {
        predict_backward_token<N, A>(StagedPredictRows<N>{stage}, slice, router, state, grad_hidden_states + t * hidden,
                                     plane, hidden, eps, router_scale);
    }
};

template <int N, int A>
__global__ void PREDICT_BACKWARD_BOUNDS altup_predict_backward_v2(PREDICT_BACKWARD_PARAMS) {
    __shared__ float scratch[32 * (1 + N + N * N)];
    __shared__ float P[N * N * N];
    load_small_matrix(prediction_coefs, P, N * N * N);
    const RowSlice slice(hidden);
    const RouterSlice<N> router{slice, router_weight, norm_weight, hidden};
    const long long plane = tokens * hidden;
    extern __shared__ float S[];  // S [N, H] fp32, then the two stages of 2N bf16 rows
    clear_weight_sums<N>(S, slice, hidden);
    PredictBackwardState<N> state{P, scratch, S, 0.0f};
    for_each_staged_token<2 * N>(reinterpret_cast<unsigned short*>(S + N * hidden), slice,
                                 PredictRowSource<N>{hidden_states, grad_predictions, plane}, tokens, hidden,
                                 PredictBackwardVisit<N, A>{slice, router, state, grad_hidden_states, plane, hidden,
                                                            eps, router_scale});
    store_weight_partials<N, N * N * N>(state.S, state.dP, slice, partials, partial_stride, hidden);
}
