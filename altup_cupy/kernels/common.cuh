// common.cuh: helpers shared by every kernel source. `_build.py` pastes each included .cuh file
// in place of its #include line, so the sources need no include path (no cuda_bf16.h either).
#pragma once

// bf16 travels as raw 16-bit words. Eight of them are one 16-byte vector (uint4), the widest
// single load or store a thread can issue.
constexpr int kVec = 8;

__device__ __forceinline__ float bf16_lo(unsigned int pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float bf16_hi(unsigned int pair) { return __uint_as_float(pair & 0xffff0000u); }

// Two fp32 -> one packed bf16x2, round to nearest even (NaN stays NaN): the hardware cvt.
__device__ __forceinline__ unsigned int pack_bf16x2(float lo, float hi) {
    unsigned int packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
    return packed;
}

// Element e (a compile-time constant after unrolling) of 8 packed bf16, without unpacking the rest.
__device__ __forceinline__ float bf16_at(const uint4& v, const int e) {
    const unsigned int pair = e < 2 ? v.x : (e < 4 ? v.y : (e < 6 ? v.z : v.w));
    return (e & 1) ? bf16_hi(pair) : bf16_lo(pair);
}

__device__ __forceinline__ void unpack_bf16x8(const uint4 v, float (&out)[kVec]) {
    out[0] = bf16_lo(v.x); out[1] = bf16_hi(v.x);
    out[2] = bf16_lo(v.y); out[3] = bf16_hi(v.y);
    out[4] = bf16_lo(v.z); out[5] = bf16_hi(v.z);
    out[6] = bf16_lo(v.w); out[7] = bf16_hi(v.w);
}

__device__ __forceinline__ uint4 pack_bf16x8(const float (&in)[kVec]) {
    return make_uint4(pack_bf16x2(in[0], in[1]), pack_bf16x2(in[2], in[3]),
                      pack_bf16x2(in[4], in[5]), pack_bf16x2(in[6], in[7]));
}

// Four packed bf16 (uint2, one 8-byte access): the half slices of predict_correct_backward_v6.
__device__ __forceinline__ float bf16_at(const uint2& v, const int e) {
    const unsigned int pair = e < 2 ? v.x : v.y;
    return (e & 1) ? bf16_hi(pair) : bf16_lo(pair);
}

__device__ __forceinline__ void unpack_bf16x4(const uint2 v, float (&out)[4]) {
    out[0] = bf16_lo(v.x); out[1] = bf16_hi(v.x);
    out[2] = bf16_lo(v.y); out[3] = bf16_hi(v.y);
}

__device__ __forceinline__ uint2 pack_bf16x4(const float (&in)[4]) {
    return make_uint2(pack_bf16x2(in[0], in[1]), pack_bf16x2(in[2], in[3]));
}

// The vector that holds E packed bf16 (E = 8: uint4, E = 4: uint2), and (un)packing by width, for
// code written once for both.
template <int E> struct Bf16Pack;
template <> struct Bf16Pack<8> { using type = uint4; };
template <> struct Bf16Pack<4> { using type = uint2; };
__device__ __forceinline__ uint4 pack_bf16(const float (&in)[8]) { return pack_bf16x8(in); }
__device__ __forceinline__ uint2 pack_bf16(const float (&in)[4]) { return pack_bf16x4(in); }
__device__ __forceinline__ void unpack_bf16(const uint4 v, float (&out)[8]) { unpack_bf16x8(v, out); }
__device__ __forceinline__ void unpack_bf16(const uint2 v, float (&out)[4]) { unpack_bf16x4(v, out); }

// Rounds each of 8 fp32 to bf16 and back (round to nearest even): a bf16 result held as fp32.
__device__ __forceinline__ void round_bf16x8(float (&v)[kVec]) { unpack_bf16x8(pack_bf16x8(v), v); }

// a + b of 8 packed bf16, summed in fp32 and rounded once: the bits of torch's bf16 addition.
__device__ __forceinline__ uint4 add_bf16x8(const uint4 a, const uint4 b) {
    float x[kVec], y[kVec];
    unpack_bf16x8(a, x);
    unpack_bf16x8(b, y);
#pragma unroll
    for (int e = 0; e < kVec; ++e) x[e] += y[e];
    return pack_bf16x8(x);
}

// cp.async: a 16-byte global -> shared copy that bypasses registers (and L1: .cg).
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src) {
    const unsigned int dst = static_cast<unsigned int>(__cvta_generic_to_shared(smem_dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Streaming (read-once) 16-byte load: bypasses L1 allocation so the reused data keeps it.
__device__ __forceinline__ uint4 load_streaming(const uint4* p) { return __ldcs(p); }
__device__ __forceinline__ float4 load_streaming(const float4* p) { return __ldcs(p); }

// Sum NV values (float or double) over the whole block at once, in a fixed order, so the result
// is bitwise reproducible. Every thread receives the totals. blockDim.x must be a multiple of 32
// and at most 1024; `scratch` holds 32 * NV values of shared memory.
template <int NV, typename T>
__device__ __forceinline__ void block_sum(T (&v)[NV], T* scratch) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) v[i] += __shfl_xor_sync(0xffffffffu, v[i], offset);
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    __syncthreads();  // an earlier call may still be reading scratch
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < NV; ++i) scratch[i * 32 + warp] = v[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        T s = lane < warps ? scratch[i * 32 + lane] : T(0);
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffffu, s, offset);
        v[i] = s;
    }
}

// Warp sums of NV values at once (NV a power of two, at most 32) with NV - 1 shuffles instead of
// 5 * NV: at each step a lane hands half of its values to its partner and keeps the other half.
// Returns, in lane l, the warp total of value l % NV. Fixed order: bitwise reproducible.
template <int NV, int WIDTH>
__device__ __forceinline__ void warp_sum_spread_step(float (&v)[NV], const int lane) {
    if constexpr (WIDTH >= 1) {
        const bool upper = lane & WIDTH;
#pragma unroll
        for (int i = 0; i < WIDTH; ++i) {
            const float send = upper ? v[i] : v[i + WIDTH];
            const float keep = upper ? v[i + WIDTH] : v[i];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, WIDTH);
        }
        warp_sum_spread_step<NV, WIDTH / 2>(v, lane);
    }
}

template <int NV>
__device__ __forceinline__ float warp_sum_spread(float (&v)[NV]) {
    static_assert(NV >= 1 && NV <= 32 && (NV & (NV - 1)) == 0, "NV must be a power of two <= 32");
    const int lane = threadIdx.x & 31;
    warp_sum_spread_step<NV, NV / 2>(v, lane);
#pragma unroll
    for (int offset = NV; offset < 32; offset <<= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], offset);
    return v[0];
}

__host__ __device__ constexpr int next_pow2(int n) { return n <= 1 ? 1 : 2 * next_pow2((n + 1) / 2); }

// block_sum for many values (the backwards' Gram products): each warp sums its NV values with
// warp_sum_spread (next_pow2(NV) - 1 shuffles where block_sum spends 5 NV), then every warp adds
// the warps' partials of value l in lane l, in warp order, and hands the NV totals round (NV
// shuffles where block_sum spends 5 NV more). Fixed order: bitwise reproducible. scratch holds
// 32 * NV floats, warp w's partials at w * NV: the lanes of a warp store and load consecutive
// words, one bank each (at l * 32 + w, every lane of a warp hit bank w: an NV-way conflict on
// the store and on each of the `warps` loads).
template <int NV>
__device__ __forceinline__ void block_sum_spread(float (&v)[NV], float* scratch) {
    constexpr int kPow2 = next_pow2(NV);
    static_assert(kPow2 <= 32, "at most 32 values");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    float padded[kPow2];
#pragma unroll
    for (int i = 0; i < kPow2; ++i) padded[i] = i < NV ? v[i] : 0.0f;
    const float warp_total = warp_sum_spread<kPow2>(padded);  // lane l: value l % kPow2
    __syncthreads();  // an earlier call may still be reading scratch
    if (lane < NV) scratch[warp * NV + lane] = warp_total;
    __syncthreads();
    float total = 0.0f;
    if (lane < NV) {
        for (int w = 0; w < warps; ++w) total += scratch[w * NV + lane];
    }
#pragma unroll
    for (int i = 0; i < NV; ++i) v[i] = __shfl_sync(0xffffffffu, total, i);
}

// y = M x + init (init added to every entry) for a row-major ROWS x COLS fp32 matrix: one fmaf per
// term, in column order, so the kernels that form C = P m or k = Q m + 1 all round alike.
template <int ROWS, int COLS>
__device__ __forceinline__ void matrix_vector(const float* __restrict__ M, const float* __restrict__ x, const float init,
                                              float (&y)[ROWS]) {
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
        float sum = init;
#pragma unroll
        for (int l = 0; l < COLS; ++l) sum = fmaf(M[i * COLS + l], x[l], sum);
        y[i] = sum;
    }
}

// y = M^T x for the same layout (the backward of matrix_vector), in row order.
template <int ROWS, int COLS>
__device__ __forceinline__ void transposed_matrix_vector(const float* __restrict__ M, const float* __restrict__ x,
                                                         float (&y)[COLS]) {
#pragma unroll
    for (int l = 0; l < COLS; ++l) {
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < ROWS; ++i) sum = fmaf(M[i * COLS + l], x[i], sum);
        y[l] = sum;
    }
}


// Programmatic dependent launch (sm_90 and later; _launch.PackedLaunch(programmatic=True) makes one
// only where the kernel was built for such a GPU). griddep_launch_dependents: the kernel after this
// one on the stream may start once every block of this one has said so (or exited); what it reads
// of this kernel's output it must not read before griddep_wait, which returns once the kernel ahead
// has finished and its writes are visible. Without such a launch both are no-ops.
__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
