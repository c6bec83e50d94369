// collapse_v4.cu: the collapse (docs/SPEC.md section 1) on Hopper (sm_90a), v4. Host side:
// ops/collapse_hopper.py.
//
// What this version changed:
//   v4: the GEMM (collapse_gemm_sm90.cuh, mode kFused) orders the units row block first and
//       counts each row block's finished units; the CTA that finishes the last one applies the
//       normalisation to those 128 rows while their y_k are still in L2 and writes the bf16
//       output: one launch, no epilogue pass over HBM. Same K-split rule as v3 (where K is split,
//       v4 runs v2's kernels).
#include "collapse_gemm_sm90.cuh"

// Named barrier 1 over the two consumer warpgroups (the producer never joins it).
__device__ __forceinline__ void consumers_sync() {
    asm volatile("bar.sync 1, %0;" ::"n"(kConsumers * kWarpgroupThreads) : "memory");
}

constexpr int kFusedBatch = 2;  // slices in flight per lane in the fused epilogue

// kFused: the collapse of the row block `row_tile`, by the 8 consumer warps of the CTA that
// finished its last unit; warp g takes rows g, g + 8, ... Same math and order as
// collapse_epilogue_v3 (stream 0's sum of squares by one warp in a fixed butterfly order).
// y_k and the statistics were written by other CTAs: read through L2 (ld.global.cg).
__device__ __forceinline__ void fused_row_block(const CollapseGemmParams& p, int row_tile) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x - kWarpgroupThreads) / 32;
    const int slices = p.hidden / kVec;
    const long long slab = p.rows * slices;  // one projection's y, in slices of kVec floats
    const float inv_hidden = 1.0f / static_cast<float>(p.hidden);
    const float inv_n = 1.0f / static_cast<float>(p.projections + 1);
    const float4* __restrict__ projected = reinterpret_cast<const float4*>(p.out);
    for (int i = warp; i < kBlockM; i += kConsumerWarps) {
        const long long row = static_cast<long long>(row_tile) * kBlockM + i;
        if (row >= p.rows) break;  // warp-uniform; later rows are past M too
        const uint4* __restrict__ s0 = p.stream0 + row * slices;
        float target_sq = 0.0f;
#pragma unroll 4
        for (int s = lane; s < slices; s += 32) {
            float v[kVec];
            unpack_bf16x8(__ldg(s0 + s), v);
#pragma unroll
            for (int e = 0; e < kVec; ++e) target_sq = fmaf(v[e], v[e], target_sq);
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) target_sq += __shfl_xor_sync(0xffffffffu, target_sq, offset);
        const float target = sqrtf(target_sq * inv_hidden);
        float scale[kMaxProjections];
#pragma unroll
        for (int k = 0; k < kMaxProjections; ++k) {
            scale[k] = 0.0f;
            if (k < p.projections) {
                const float* partial = p.row_sumsq + (k * p.rows + row) * p.col_tiles;
                float sum_sq = 0.0f;
                for (int t = 0; t < p.col_tiles; ++t) sum_sq += __ldcg(partial + t);
                scale[k] = target / sqrtf(fmaxf(sum_sq * inv_hidden, p.eps)) * inv_n;
            }
        }
        uint4* __restrict__ out = p.out_bf16 + row * slices;
        for (int first = lane; first < slices; first += 32 * kFusedBatch) {
            // All loads of the batch first, then the math and the stores: kFusedBatch slices of
            // every stream in flight per lane.
            uint4 x0[kFusedBatch];
            float4 y[kMaxProjections][kFusedBatch][2];
#pragma unroll
            for (int b = 0; b < kFusedBatch; ++b) {
                const int s = first + 32 * b;
                if (s < slices) {
                    x0[b] = __ldg(s0 + s);
#pragma unroll
                    for (int k = 0; k < kMaxProjections; ++k) {
                        if (k < p.projections) {
                            const float4* src = projected + 2 * (k * slab + row * slices + s);
                            y[k][b][0] = __ldcg(src);
                            y[k][b][1] = __ldcg(src + 1);
                        }
                    }
                }
            }
#pragma unroll
            for (int b = 0; b < kFusedBatch; ++b) {
                const int s = first + 32 * b;
                if (s < slices) {
                    float result[kVec];
                    unpack_bf16x8(x0[b], result);
#pragma unroll
                    for (int e = 0; e < kVec; ++e) result[e] *= inv_n;
#pragma unroll
                    for (int k = 0; k < kMaxProjections; ++k) {
                        if (k < p.projections) {
                            const float yk[kVec] = {y[k][b][0].x, y[k][b][0].y, y[k][b][0].z, y[k][b][0].w,
                                                    y[k][b][1].x, y[k][b][1].y, y[k][b][1].z, y[k][b][1].w};
#pragma unroll
                            for (int e = 0; e < kVec; ++e) result[e] = fmaf(yk[e], scale[k], result[e]);
                        }
                    }
                    out[s] = pack_bf16x8(result);
                }
            }
        }
    }
}

// After a unit's tile is stored: count the unit in its row block; the CTA that counts the last one
// finishes the row block (and resets its counter for the next launch).
template <int MODE>
__device__ __forceinline__ void finish_unit(const CollapseGemmParams& p, const WorkUnit& w, unsigned int flag) {
    static_assert(MODE == kFused, "only the fused mode counts its units");
    __threadfence();  // this thread's y and statistics are visible GPU-wide before the count
    consumers_sync();
    if (threadIdx.x == kWarpgroupThreads) {
        const unsigned int units_per_row_block = p.projections * p.col_tiles;
        const unsigned int counted = atomicAdd(p.row_counters + w.row_tile, 1u) + 1;
        const unsigned int last = counted == units_per_row_block;
        if (last) p.row_counters[w.row_tile] = 0;
        asm volatile("st.shared.u32 [%0], %1;" ::"r"(flag), "r"(last) : "memory");
    }
    consumers_sync();
    unsigned int last;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(last) : "r"(flag) : "memory");
    if (last) {
        __threadfence();  // the other CTAs' y and statistics, counted before ours, are visible
        fused_row_block(p, w.row_tile);
    }
}
