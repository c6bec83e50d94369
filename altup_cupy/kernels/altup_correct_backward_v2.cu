// altup_correct_backward_v2.cu: Gemma 3n's AltUp correct backward, v1's arithmetic with the next
// token's rows in flight while the block works on this one.
//
// What this version changed: v1 loads a token's N + 2 rows (g, x, pred_a) when it starts on the
// token, so each token begins with a full memory latency that only the SM's other block overlaps
// (1.8x its copy floor at M = 8192). Here every thread copies its own 16-byte slice of the next
// token's rows into shared memory with cp.async before it starts on this token, two stages deep
// (staged_rows.cuh), and reads this token's rows from the stage that arrived.
//
// Dynamic shared memory: S (N * H fp32, as v1) then 2 stages of N + 2 bf16 rows, 4 (N + 2) H bytes
// more than v1 (48 KB at N = 4, H = 2048). The host picks v1 where that does not fit the device.
#include "altup_correct_v1.cu"
#include "staged_rows.cuh"

// Row r of a token's stage: g_r for r < N, then x, then pred_a (token 0's rows; the stager adds t * H).
template <int N, int A>
struct CorrectRowSource {
    const unsigned short* grad_corrected;
    const unsigned short* activated;
    const unsigned short* predictions;
    long long plane;
    __device__ __forceinline__ const unsigned short* operator()(const int r) const {
        return r < N ? grad_corrected + r * plane : (r == N ? activated : predictions + A * plane);
    }
};

// The token rows correct_backward_token reads, from a stage laid out as CorrectRowSource.
template <int N>
struct StagedCorrectRows {
    StagedRows<N + 2> stage;
    __device__ __forceinline__ void g(const int i, float (&out)[kVec]) const { stage.row(i, out); }
    __device__ __forceinline__ void x(float (&out)[kVec]) const { stage.row(N, out); }
    __device__ __forceinline__ void pred_a(float (&out)[kVec]) const { stage.row(N + 1, out); }
};

template <int N, int A>
struct CorrectBackwardVisit {
    const RowSlice& slice;
    const RouterSlice<N>& router;
    CorrectBackwardState<N>& state;
    unsigned short* grad_predictions;
    unsigned short* grad_activated;
    long long plane;
    int hidden;
    float eps, router_scale;
    __device__ __forceinline__ void operator()(const long long t, const StagedRows<N + 2>& stage) const {
        correct_backward_token<N, A>(StagedCorrectRows<N>{stage}, slice, router, state, grad_predictions + t * hidden,
                                     grad_activated + t * hidden, plane, hidden, eps, router_scale);
    }
};

template <int N, int A>
__global__ void __launch_bounds__(kRowThreadsMax) altup_correct_backward_v2(CORRECT_BACKWARD_PARAMS) {
    __shared__ float scratch[32 * (1 + 3 * N)];
    __shared__ float Q[N * N];
    load_small_matrix(correction_coefs, Q, N * N);
    const RowSlice slice(hidden);
    const RouterSlice<N> router{slice, router_weight, norm_weight, hidden};
    const long long plane = tokens * hidden;
    extern __shared__ float S[];  // S [N, H] fp32, then the two stages of N + 2 bf16 rows
    clear_weight_sums<N>(S, slice, hidden);
    CorrectBackwardState<N> state{Q, scratch, S, 0.0f};
    for_each_staged_token<N + 2>(reinterpret_cast<unsigned short*>(S + N * hidden), slice, CorrectRowSource<N, A>{grad_corrected, activated, predictions, plane},
                                 tokens, hidden,
                                 CorrectBackwardVisit<N, A>{slice, router, state, grad_predictions, grad_activated,
                                                            plane, hidden, eps, router_scale});
    store_weight_partials<N, N * N>(state.S, state.dQ, slice, partials, partial_stride, hidden);
}
