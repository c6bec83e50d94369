// collapse_gemm_sm90.cuh: the collapse's projections y_k = x_k @ W_k^T on Hopper (sm_90a), all N-1
// streams in one persistent launch: the GEMM of collapse v2 and v3, which differ in its epilogue
// mode (the template argument); each version's .cu instantiates its own. Host side:
// ops/collapse_hopper.py.
//
// Tile 128 x 256 x 64 (rows x columns x K per stage), bf16 in, fp32 accumulate in registers.
// Warp roles: warpgroup 0 is the producer (one thread issues the TMA tile loads, the rest leave
// after giving their registers back); warpgroups 1 and 2 are consumers, each computing 64 rows x
// 256 columns with wgmma.m64n256k16 (A and B from shared memory, 128-byte swizzle, both K-major
// because x_k and W_k are both stored row-major with K innermost).
// Shared memory: a ring of kStages stages of (A 128 x 64, B 256 x 64) bf16 = 48 KiB each; stage s
// is "full" when its TMA bytes have landed (mbarrier with transaction count) and "empty" when all
// 8 consumer warps have finished the wgmma that read it.
// Work units (stream, row tile, column tile, K split) are handed out round-robin over a grid of at
// most one CTA per SM; the host picks the K splits so that small M still fills every SM, each
// split writing its own fp32 partial (summed later in a fixed order: deterministic).
// Tails: TMA fills out-of-bounds rows/columns of a box with zeros (any M >= 1, any H divisible
// by 8); stores are guarded by row and by 8-column chunk.
//
// Epilogue modes (the template argument of collapse_gemm_sm90):
//   kStoreY (v2):      store y_k (fp32), or the K split's partial of it.
//   kStoreYStats (v3): also each row's sum of squares over the tile's columns, from the fp32
//                      accumulators (4 lanes per row combined in a fixed order), no K split.
#pragma once
#include "common.cuh"

constexpr int kStoreY = 0;
constexpr int kStoreYStats = 1;

constexpr int kBlockM = ALTUP_COLLAPSE_V2_BLOCK_M;
constexpr int kBlockN = ALTUP_COLLAPSE_V2_BLOCK_N;
constexpr int kBlockK = ALTUP_COLLAPSE_V2_BLOCK_K;  // 64 bf16 = 128 bytes: one row of the 128-byte swizzle
constexpr int kStages = ALTUP_COLLAPSE_V2_STAGES;
constexpr int kConsumers = ALTUP_COLLAPSE_V2_CONSUMERS;
constexpr int kWarpgroupThreads = 4 * 32;  // a warpgroup is 4 warps (hardware, not a tuning choice)
constexpr int kThreads = kWarpgroupThreads * (1 + kConsumers);
constexpr int kTileABytes = kBlockM * kBlockK * 2;
constexpr int kTileBBytes = kBlockN * kBlockK * 2;
constexpr int kStageBytes = kTileABytes + kTileBBytes;
constexpr int kSwizzleAlign = ALTUP_COLLAPSE_V2_SWIZZLE_ALIGN;  // the 128-byte swizzle repeats every 8 rows of 128 bytes
constexpr int kBarrierBytes = 2 * kStages * 8;  // full + empty barriers
constexpr int kSharedBytes = kSwizzleAlign + kStages * kStageBytes + kBarrierBytes;
static_assert(kSharedBytes <= 227 * 1024, "more dynamic shared memory than an sm_90 block may have");
constexpr int kMaxProjections = ALTUP_COLLAPSE_V2_MAX_PROJECTIONS;  // N <= 4
constexpr int kConsumerWarps = 4 * kConsumers;
constexpr int kProducerRegisters = 40;
constexpr int kConsumerRegisters = 232;
static_assert(kWarpgroupThreads * (kProducerRegisters + kConsumers * kConsumerRegisters) <= 65536,
              "register reallocation exceeds the register file");

// The driver's CUtensorMap: 128 opaque bytes, 64-byte aligned, built on the host.
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

// Passed by value as one __grid_constant__ parameter (the tensor maps must live in parameter
// space). collapse_hopper.py packs the same layout; the asserts pin it.
struct CollapseGemmParams {
    TensorMap x_maps[kMaxProjections];  // hidden_states[k + 1] as [M, H] bf16
    TensorMap w_maps[kMaxProjections];  // W_k as [H, H] bf16
    float* out;                         // [splits, N - 1, M, H] fp32
    float* row_sumsq;                   // [N - 1, M, column tiles] fp32, or null
    long long rows;                     // M
    int hidden;                         // H
    int projections;                    // N - 1
    int row_tiles;
    int col_tiles;
    int k_blocks;                       // ceil(H / kBlockK)
    int splits;
    int k_blocks_per_split;
    int units;                          // (N - 1) * row_tiles * col_tiles * splits
};
// The host packs this struct byte for byte (collapse_hopper.PARAM_FIELDS: natural C layout,
// checked against the declaration by tests/test_collapse_hopper.py).
static_assert(sizeof(CollapseGemmParams) == 832, "host layout");

__device__ __forceinline__ unsigned int shared_address(const void* p) {
    return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}

// ---- mbarriers ---------------------------------------------------------------------------------
__device__ __forceinline__ void barrier_init(unsigned int bar, unsigned int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void barrier_wait(unsigned int bar, unsigned int parity) {
    unsigned int done = 0;
    do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            " selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

__device__ __forceinline__ void barrier_arrive(unsigned int bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void barrier_arrive_expect_bytes(unsigned int bar, unsigned int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// One box of a 2D tensor map into shared memory; completes `bytes` on `bar`. Coordinates are
// (element along the row, row); boxes reaching past the tensor are filled with zeros.
__device__ __forceinline__ void tma_load_2d(unsigned int dst, const TensorMap* map, int inner, int row,
                                            unsigned int bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(inner), "r"(row), "r"(bar)
        : "memory");
}

// ---- wgmma -------------------------------------------------------------------------------------
// Shared-memory matrix descriptor of a K-major tile written by TMA with the 128-byte swizzle:
// rows of 128 bytes, 8-row groups 1024 bytes apart (stride byte offset), the leading byte offset
// unused for this layout (1 by convention), layout type 1 = 128-byte swizzle. Advancing K by 16
// elements inside the 128-byte row adds 32 bytes to the start address (2 in units of 16 bytes).
__device__ __forceinline__ unsigned long long smem_descriptor(unsigned int address) {
    return static_cast<unsigned long long>((address & 0x3FFFF) >> 4) | (1ull << 16) |
           (static_cast<unsigned long long>(kSwizzleAlign >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across a wgmma fence or wait.
__device__ __forceinline__ void fence_accumulators(float (&d)[128]) {
#pragma unroll
    for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d[64 x 256] += A[64 x 16] * B[256 x 16]^T, fp32 accumulators, bf16 operands from shared memory.
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n"
        ".reg .pred accumulate;\n"
        "setp.ne.b32 accumulate, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, accumulate, 1, 1, 0, 0;\n"
        "}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(a), "l"(b), "r"(1));
}

__device__ __forceinline__ void set_max_registers_producer() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegisters));
}
__device__ __forceinline__ void set_max_registers_consumer() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegisters));
}

// ---- schedule ----------------------------------------------------------------------------------
struct WorkUnit {
    int projection;  // k - 1
    int row_tile;
    int col_tile;
    int split;
    int k_begin;     // in k blocks
    int k_end;
};

// Unit order: projection, row tile, column tile, split (innermost): CTAs running at the same time
// share one row tile of x_k and walk the columns of W_k, which stays in L2.
__device__ __forceinline__ WorkUnit decode_unit(const CollapseGemmParams& p, int unit) {
    WorkUnit w;
    w.split = unit % p.splits;
    int rest = unit / p.splits;
    w.col_tile = rest % p.col_tiles;
    rest /= p.col_tiles;
    w.row_tile = rest % p.row_tiles;
    w.projection = rest / p.row_tiles;
    w.k_begin = w.split * p.k_blocks_per_split;
    w.k_end = min(p.k_blocks, w.k_begin + p.k_blocks_per_split);
    return w;
}

__device__ __forceinline__ void produce(const CollapseGemmParams& p, unsigned int tiles, unsigned int bars) {
    int stage = 0;
    unsigned int phase = 0;
    for (int unit = blockIdx.x; unit < p.units; unit += gridDim.x) {
        const WorkUnit w = decode_unit(p, unit);
        for (int kb = w.k_begin; kb < w.k_end; ++kb) {
            const unsigned int full = bars + 8 * stage, empty = bars + 8 * (kStages + stage);
            barrier_wait(empty, phase ^ 1);  // a fresh barrier counts as released once
            barrier_arrive_expect_bytes(full, kStageBytes);
            const unsigned int a = tiles + stage * kStageBytes;
            tma_load_2d(a, &p.x_maps[w.projection], kb * kBlockK, w.row_tile * kBlockM, full);
            tma_load_2d(a + kTileABytes, &p.w_maps[w.projection], kb * kBlockK, w.col_tile * kBlockN, full);
            if (++stage == kStages) { stage = 0; phase ^= 1; }
        }
    }
}

// Accumulator layout of wgmma m64nN: thread (warp, lane) of a consumer holds rows
// 16 warp + lane / 4 and + 8, columns 8 j + 2 (lane % 4) + {0, 1}, in d[4 j + {0, 1}] and
// d[4 j + {2, 3}]. Stores this consumer's 64 rows of the unit's tile (and their statistics).
template <int MODE>
__device__ __forceinline__ void store_tile(const CollapseGemmParams& p, const WorkUnit& w, long long first_row,
                                           const float (&d)[128]) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const long long row = first_row + 16 * warp + lane / 4;
    const int col0 = w.col_tile * kBlockN;
    const int hidden = p.hidden;
    float* out = p.out + ((static_cast<long long>(w.split) * p.projections + w.projection) * p.rows) * hidden;
    float sumsq_lo = 0.0f, sumsq_hi = 0.0f;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
        // H is a multiple of 8, so an 8-column chunk is entirely inside the row or outside it.
        if (col0 + 8 * j < hidden) {
            const int col = col0 + 8 * j + 2 * (lane % 4);
            if (row < p.rows)
                *reinterpret_cast<float2*>(out + row * hidden + col) = make_float2(d[4 * j], d[4 * j + 1]);
            if (row + 8 < p.rows)
                *reinterpret_cast<float2*>(out + (row + 8) * hidden + col) = make_float2(d[4 * j + 2], d[4 * j + 3]);
        }
        if constexpr (MODE == kStoreYStats) {
            // Columns past H hold exact zeros (zero-filled W rows): no guard needed.
            sumsq_lo = fmaf(d[4 * j], d[4 * j], sumsq_lo);
            sumsq_lo = fmaf(d[4 * j + 1], d[4 * j + 1], sumsq_lo);
            sumsq_hi = fmaf(d[4 * j + 2], d[4 * j + 2], sumsq_hi);
            sumsq_hi = fmaf(d[4 * j + 3], d[4 * j + 3], sumsq_hi);
        }
    }
    if constexpr (MODE == kStoreYStats) {
        // The 4 lanes of a row combine in a fixed butterfly order: deterministic.
#pragma unroll
        for (int offset = 1; offset < 4; offset <<= 1) {
            sumsq_lo += __shfl_xor_sync(0xffffffffu, sumsq_lo, offset);
            sumsq_hi += __shfl_xor_sync(0xffffffffu, sumsq_hi, offset);
        }
        if (lane % 4 == 0) {
            float* stats = p.row_sumsq + static_cast<long long>(w.projection) * p.rows * p.col_tiles + w.col_tile;
            if (row < p.rows) stats[row * p.col_tiles] = sumsq_lo;
            if (row + 8 < p.rows) stats[(row + 8) * p.col_tiles] = sumsq_hi;
        }
    }
}

// Consumer `c` (0 or 1) computes rows [64c, 64c + 64) of each unit's tile.
template <int MODE>
__device__ __forceinline__ void consume(const CollapseGemmParams& p, unsigned int tiles, unsigned int bars, int c) {
    const int lane = threadIdx.x % 32;
    int stage = 0;
    unsigned int phase = 0;
    float d[128];
    for (int unit = blockIdx.x; unit < p.units; unit += gridDim.x) {
        const WorkUnit w = decode_unit(p, unit);
        const long long first_row = static_cast<long long>(w.row_tile) * kBlockM + 64 * c;
#pragma unroll
        for (int i = 0; i < 128; ++i) d[i] = 0.0f;
        int previous = -1;
        for (int kb = w.k_begin; kb < w.k_end; ++kb) {
            barrier_wait(bars + 8 * stage, phase);
            const unsigned int a = tiles + stage * kStageBytes + c * (64 * kBlockK * 2);
            const unsigned long long da = smem_descriptor(a);
            const unsigned long long db = smem_descriptor(tiles + stage * kStageBytes + kTileABytes);
            wgmma_fence();
#pragma unroll
            for (int k = 0; k < kBlockK / 16; ++k) wgmma_m64n256k16(d, da + 2 * k, db + 2 * k);
            wgmma_commit();
            wgmma_wait<1>();  // the previous k block's wgmma are done with their stage
            fence_accumulators(d);
            __syncwarp();
            if (previous >= 0 && lane == 0) barrier_arrive(bars + 8 * (kStages + previous));
            previous = stage;
            if (++stage == kStages) { stage = 0; phase ^= 1; }
        }
        wgmma_wait<0>();
        fence_accumulators(d);
        __syncwarp();
        if (previous >= 0 && lane == 0) barrier_arrive(bars + 8 * (kStages + previous));
        if (first_row < p.rows) store_tile<MODE>(p, w, first_row, d);  // else: all rows past M
    }
}

// y_k = x_k @ W_k^T for every projection, with the epilogue MODE (kStoreY, kStoreYStats).
template <int MODE>
__global__ void __launch_bounds__(kThreads, 1) collapse_gemm_sm90(const __grid_constant__ CollapseGemmParams p) {
    static_assert(MODE == kStoreY || MODE == kStoreYStats, "unknown epilogue mode");
    extern __shared__ unsigned char shared_raw[];
    const unsigned int raw = shared_address(shared_raw);
    const unsigned int tiles = (raw + kSwizzleAlign - 1) & ~static_cast<unsigned int>(kSwizzleAlign - 1);
    const unsigned int bars = tiles + kStages * kStageBytes;
    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) {
            barrier_init(bars + 8 * s, 1);                          // full: the producer's arrival + bytes
            barrier_init(bars + 8 * (kStages + s), kConsumerWarps);  // empty: every consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int warpgroup = threadIdx.x / kWarpgroupThreads;
    if (warpgroup == 0) {
        set_max_registers_producer();
        if (threadIdx.x == 0) produce(p, tiles, bars);
    } else {
        set_max_registers_consumer();
        consume<MODE>(p, tiles, bars, warpgroup - 1);
    }
}
