// altup_rows.cuh: the per-token row layout shared by the Gemma 3n AltUp step kernels, and the
// router route(x) = tanh(R (x * rsqrt(mean(x^2) + eps) * w / H)) forward and backward on it.
//
// One block works on one token at a time. Thread t holds elements [8t, 8t + 8) of every row of
// that token (one 16-byte bf16 vector or two float4), so a row of H elements needs H / 8 threads;
// threads past the row hold zeros and store nothing. The block has a multiple of 32 threads.
#pragma once

// H <= 8 * kRowThreadsMax (3072: Gemma 3n has 2048 and 2560): launch bounds of 384 threads leave
// 168 registers a thread, room for the backward kernels at N = 4 (which cap themselves lower on
// sm_90: ROUTED_BACKWARD_BOUNDS).
constexpr int kRowThreadsMax = ALTUP_ROW_THREADS_MAX;

// The predict and correct backwards: registers decide how many blocks share an SM, and one block
// is too few to keep the memory busy. On sm_90 both fit 128 registers with no spills, so two
// blocks of 256 threads (H = 2048) share an SM. The sm_8x compilers spill a few bytes under that
// cap, so there the kernels stay uncapped; the explicit minimum of one block is no constraint, yet
// without it NVRTC 13.0 settles on 56 registers and spills in <3, 1> and <3, 2>.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define ROUTED_BACKWARD_BOUNDS __maxnreg__(128)
#else
#define ROUTED_BACKWARD_BOUNDS __launch_bounds__(kRowThreadsMax, 1)
#endif

struct RowSlice {
    long long d0;  // first element of this thread's slice
    bool active;   // the slice lies inside the row
    __device__ __forceinline__ explicit RowSlice(const int hidden)
        : d0(static_cast<long long>(threadIdx.x) * kVec), active(threadIdx.x * kVec < hidden) {}

    // What a thread past the row holds.
    __device__ __forceinline__ static void zeros(float (&out)[kVec]) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) out[e] = 0.0f;
    }

    __device__ __forceinline__ void load(const unsigned short* row, float (&out)[kVec]) const {
        if (active) {
            unpack_bf16x8(load_streaming(reinterpret_cast<const uint4*>(row + d0)), out);
        } else {
            zeros(out);
        }
    }
    __device__ __forceinline__ void load(const float* row, float (&out)[kVec]) const {
        if (active) {
            const float4 lo = load_streaming(reinterpret_cast<const float4*>(row + d0));
            const float4 hi = load_streaming(reinterpret_cast<const float4*>(row + d0) + 1);
            out[0] = lo.x; out[1] = lo.y; out[2] = lo.z; out[3] = lo.w;
            out[4] = hi.x; out[5] = hi.y; out[6] = hi.z; out[7] = hi.w;
        } else {
            zeros(out);
        }
    }
    // The slice still packed (8 bf16 in 4 registers, where `load` takes 8), zeros past the row.
    __device__ __forceinline__ uint4 load_packed(const unsigned short* row) const {
        return active ? load_streaming(reinterpret_cast<const uint4*>(row + d0)) : make_uint4(0, 0, 0, 0);
    }
    // Weights every block reads: through the read-only cache, kept in L1/L2.
    __device__ __forceinline__ void load_reused(const unsigned short* row, float (&out)[kVec]) const {
        if (active) {
            unpack_bf16x8(__ldg(reinterpret_cast<const uint4*>(row + d0)), out);
        } else {
            zeros(out);
        }
    }
    __device__ __forceinline__ void store(unsigned short* row, const float (&in)[kVec]) const {
        if (active) *reinterpret_cast<uint4*>(row + d0) = pack_bf16x8(in);
    }
    __device__ __forceinline__ void store(float* row, const float (&in)[kVec]) const {
        if (active) {
            reinterpret_cast<float4*>(row + d0)[0] = make_float4(in[0], in[1], in[2], in[3]);
            reinterpret_cast<float4*>(row + d0)[1] = make_float4(in[4], in[5], in[6], in[7]);
        }
    }
};

__device__ __forceinline__ float dot8(const float (&x)[kVec], const float (&y)[kVec]) {
    float s = 0.0f;
#pragma unroll
    for (int e = 0; e < kVec; ++e) s = fmaf(x[e], y[e], s);
    return s;
}

// route(x) = tanh(R (x * rsqrt(mean(x^2) + eps) * w * s)), s the router's input scale.
// The router weight R [N, H] and the norm weight w [H] as this thread's slice sees them. They are
// read where they are used (every block reads the same few KB: L1 hits), not held in registers,
// which the token's rows and the weight-gradient accumulators need.
template <int N>
struct RouterSlice {
    const RowSlice& slice;
    const unsigned short* router_weight;
    const unsigned short* norm_weight;
    int hidden;

    // This thread's share of A_n = sum_d R_nd w_d x_d (route's pre-activation before r s).
    __device__ __forceinline__ void project(const float (&x)[kVec], float* A) const {
        float w[kVec];
        slice.load_reused(norm_weight, w);
#pragma unroll
        for (int n = 0; n < N; ++n) {
            float R[kVec];
            slice.load_reused(router_weight + static_cast<long long>(n) * hidden, R);
            float s = 0.0f;
#pragma unroll
            for (int e = 0; e < kVec; ++e) s = fmaf(R[e] * w[e], x[e], s);
            A[n] = s;
        }
    }

    // gx = r * gu - r^3 x <gu, x> / H with gu = (R^T gz) w s, written as
    // w (R^T alpha) - beta x, alpha = r gz s, beta = r^3 s <gz, A> / H (<gu, x> = s <gz, A>).
    __device__ __forceinline__ void input_grad(const float (&alpha)[N], const float beta,
                                               const float (&x)[kVec], float (&gx)[kVec]) const {
        float s[kVec] = {};
#pragma unroll
        for (int n = 0; n < N; ++n) {
            float R[kVec];
            slice.load_reused(router_weight + static_cast<long long>(n) * hidden, R);
#pragma unroll
            for (int e = 0; e < kVec; ++e) s[e] = fmaf(alpha[n], R[e], s[e]);
        }
        float w[kVec];
        slice.load_reused(norm_weight, w);
#pragma unroll
        for (int e = 0; e < kVec; ++e) gx[e] = fmaf(w[e], s[e], -beta * x[e]);
    }
};

// The per-token router scalars from the block sums ss = <x, x> and A: r = rsqrt(ss / H + eps) and
// m = tanh(r A s), where s is the router's input scale (transformers' `router_input_scale`:
// 1 / H in the model's dtype).
template <int N>
struct RouterScalars {
    float r;
    float m[N];
    float inv_h;  // 1 / H: multiplied, since a division's slow path would need a stack frame
    __device__ __forceinline__ RouterScalars(const float ss, const float* A, const int hidden, const float eps,
                                             const float scale) {
        inv_h = 1.0f / static_cast<float>(hidden);
        r = rsqrtf(fmaf(ss, inv_h, eps));
#pragma unroll
        for (int n = 0; n < N; ++n) m[n] = tanhf(r * A[n] * scale);
    }

    // alpha_n = r gz_n s and beta = r^3 s <gz, A> / H for the upstream gradient gm of m.
    __device__ __forceinline__ float backward(const float (&gm)[N], const float* A, const float scale,
                                              float (&gz)[N], float (&alpha)[N]) const {
        float s = 0.0f;
#pragma unroll
        for (int n = 0; n < N; ++n) {
            gz[n] = gm[n] * (1.0f - m[n] * m[n]);
            alpha[n] = r * gz[n] * scale;
            s = fmaf(gz[n], A[n], s);
        }
        return r * r * r * scale * s * inv_h;
    }
};

// What a backward's row policy (the template argument Rows of the predict and correct backward)
// carries from one of the block's tokens to its next, where it loads each token when its turn
// comes: nothing.
struct NothingAhead {
    template <typename TokenRows>
    __device__ __forceinline__ NothingAhead(const RowSlice&, const TokenRows&, const long long, const long long) {}
};

// What a row policy that loads the block's next token while it works on this one carries: the next
// token's rows, as `Rows` (a struct with `load(slice, rows, t)`) holds them, loaded by `load(t)`
// (nothing past the last token).
template <typename Rows, typename TokenRows>
struct RowsAhead {
    Rows next;
    const RowSlice& slice;
    const TokenRows& rows;
    const long long tokens;
    __device__ __forceinline__ RowsAhead(const RowSlice& slice, const TokenRows& rows, const long long t,
                                         const long long tokens)
        : slice(slice), rows(rows), tokens(tokens) {
        load(t);
    }
    __device__ __forceinline__ void load(const long long t) {
        if (t < tokens) next.load(slice, rows, t);
    }
};

// Loads a small bf16 matrix (the coefficient weights, <= 64 entries) into shared memory as fp32.
__device__ __forceinline__ void load_small_matrix(const unsigned short* src, float* dst, const int count) {
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
        dst[i] = __uint_as_float(static_cast<unsigned int>(src[i]) << 16);
    }
    __syncthreads();
}

// The backwards' router weight-gradient sums S [N, H] (S_nd = sum over the block's tokens of
// r gz_n x_d, x the routed row) live in dynamic shared memory: in registers they would spill at
// N = 4. Each thread touches only its own slice, so no barrier guards them. Two layouts, one per
// kernel version; both add the same products in the same order, so their results are bitwise equal.
//
// v1, row-major: S_nd at n * H + d, N * H floats. A thread's 8 elements are adjacent, so the 32
// lanes of a warp, reading element e, touch words 8 apart: 4 of the 32 banks, 8 lanes per bank,
// 8 shared-memory wavefronts per access instead of 1.
struct RowMajorSums {
    __device__ __forceinline__ static float& at(float* S, const int n, const int e, const RowSlice& slice,
                                                const int hidden) {
        return S[n * hidden + slice.d0 + e];
    }
};

// v2, slice-major: element e of stream n of thread t at (8 n + e) * kRowThreadsMax + t, 8 N
// kRowThreadsMax floats (48 KiB at N = 4). Lanes read consecutive words: no bank conflict. The
// plane stride is a constant, not blockDim.x, so every access is one base register plus an
// immediate offset (with blockDim.x, <4, 0> of the correct backward spilled at 128 registers).
struct SliceMajorSums {
    __device__ __forceinline__ static float& at(float* S, const int n, const int e, const RowSlice&, const int) {
        return S[(n * kVec + e) * kRowThreadsMax + threadIdx.x];
    }
};

template <int N, typename Sums>
__device__ __forceinline__ void clear_weight_sums(float* S, const RowSlice& slice, const int hidden) {
    if (!slice.active) return;
#pragma unroll
    for (int n = 0; n < N; ++n) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) Sums::at(S, n, e, slice, hidden) = 0.0f;
    }
}

// One token's share: S_n += r gz_n x.
template <int N, typename Sums>
__device__ __forceinline__ void accumulate_weight_sums(float* S, const RowSlice& slice, const int hidden,
                                                       const float r, const float (&gz)[N],
                                                       const float (&x)[kVec]) {
    if (!slice.active) return;
#pragma unroll
    for (int n = 0; n < N; ++n) {
        const float scale = r * gz[n];
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
            float& s = Sums::at(S, n, e, slice, hidden);
            s = fmaf(scale, x[e], s);
        }
    }
}

// The block's partial row: S (row-major, whatever the layout in shared memory), then COEFS
// coefficient-gradient entries (thread e < COEFS holds entry e in coef_grad).
template <int N, int COEFS, typename Sums>
__device__ __forceinline__ void store_weight_partials(float* S, const float coef_grad, const RowSlice& slice,
                                                      float* partials, const long long partial_stride,
                                                      const int hidden) {
    float* partial = partials + blockIdx.x * partial_stride;
#pragma unroll
    for (int n = 0; n < N; ++n) {
        float row[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) row[e] = slice.active ? Sums::at(S, n, e, slice, hidden) : 0.0f;
        slice.store(partial + static_cast<long long>(n) * hidden, row);
    }
    if (threadIdx.x < COEFS) partial[static_cast<long long>(N) * hidden + threadIdx.x] = coef_grad;
}
