// weight_grad_partials.cuh: the per-block weight-gradient partials every backward version writes
// and predict_correct_backward_reduce adds up.
#pragma once

// Per-block weight-gradient partial layout: dR [N*H] | dw [H] in fp32, then the coefficient
// gradients dP [N*N*N] | dQ [N*N] in fp64 (two floats each).
//
// Why fp64 for the coefficient gradients: each of their N^3 + N^2 entries (12 at N = 2) sums a
// product of per-token scalars over every token. Accumulated per block and summed across blocks in
// fp32, their rounding error came close to the per-token values' own error, and on so few numbers
// the relative L2 error then crossed twice plain PyTorch fp32's now and then (N = 2, H = 2560, 600
// tokens: 1.07e-6 against 2 x 5.29e-7). With fp64 accuracy from the products (two fp32 scalars
// multiply exactly in fp64) to the final sum, each entry is rounded to fp32 once, at the end. v3
// keeps its per-block sums as fp32 pairs of that accuracy (add_product_compensated). The cost: a
// few dozen adds per token and a few hundred bytes per block, next to (N + 1) H fp32 columns. The
// router and norm-weight gradients stay fp32.
__host__ __device__ constexpr int coef_grad_entries(int n) { return n * n * n + n * n; }

__host__ __device__ constexpr long long partial_stride(int n, int hidden) {
    return static_cast<long long>(n + 1) * hidden + 2LL * coef_grad_entries(n);
}

// The host sizes the partials from the same layout (_sources.partial_stride): a drift fails here.
static_assert(partial_stride(2, 0) == ALTUP_PARTIAL_COEF_FLOATS_2, "_sources.partial_stride, N = 2");
static_assert(partial_stride(3, 0) == ALTUP_PARTIAL_COEF_FLOATS_3, "_sources.partial_stride, N = 3");
static_assert(partial_stride(4, 0) == ALTUP_PARTIAL_COEF_FLOATS_4, "_sources.partial_stride, N = 4");

// The fp32 part of a partial row in 16-byte columns (float4): (N + 1) H / 4, a whole number as H
// is a multiple of 8, and even, so the fp64 part after it is 16-byte aligned (rows start at
// multiples of 16 bytes: the stride is a multiple of 4 floats).
template <int N>
__device__ __forceinline__ long long fp32_columns(const int hidden) {
    return static_cast<long long>(N + 1) * hidden / 4;
}

// A block's coefficient-gradient partials (dP then dQ, fp64) in its partial row `part`.
template <int N>
__device__ __forceinline__ double* coef_grad_partials(float* __restrict__ part, const int hidden) {
    return reinterpret_cast<double*>(part) + 2 * fp32_columns<N>(hidden);
}
template <int N>
__device__ __forceinline__ const double* coef_grad_partials(const float* __restrict__ part, const int hidden) {
    return reinterpret_cast<const double*>(part) + 2 * fp32_columns<N>(hidden);
}

// sum + error += a * b, where error collects the rounding errors of the product (exact by fma) and
// of the sum (TwoSum, exact too): sum + error carries about fp64's accuracy in two fp32 values.
// For v3, whose 96 registers a thread have no room for an fp64 accumulator. The _rn intrinsics
// keep the compiler from contracting the product and the sum into one fma, which TwoSum's
// identities do not hold for.
__device__ __forceinline__ void add_product_compensated(float& sum, float& error, const float a, const float b) {
    const float product = __fmul_rn(a, b);
    const float product_error = fmaf(a, b, -product);
    const float total = __fadd_rn(sum, product);
    const float product_in_total = __fsub_rn(total, sum);
    const float sum_error = __fadd_rn(__fsub_rn(sum, __fsub_rn(total, product_in_total)),
                                      __fsub_rn(product, product_in_total));
    error += sum_error + product_error;
    sum = total;
}

__device__ __forceinline__ void add_column(float4& sum, const float4 x) {
    sum.x += x.x; sum.y += x.y; sum.z += x.z; sum.w += x.w;
}
__device__ __forceinline__ void add_column(double& sum, const double x) { sum += x; }

// The four fp32 weight gradients, written from the partials' column sums: an fp32 column e4 into
// the router and norm-weight gradients ([N, H], [H]: consecutive in the layout); fp64 entries
// into the coefficient gradients ([N*N, N], [N, N]), each rounded to fp32 once, here.
template <int N>
struct WeightGrads {
    float* __restrict__ router;
    float* __restrict__ norm;
    float* __restrict__ pred;
    float* __restrict__ corr;
    int hidden;

    __device__ __forceinline__ void store(const long long e4, const float4 sum) const {
        const float values[4] = {sum.x, sum.y, sum.z, sum.w};
        const long long nh = static_cast<long long>(N) * hidden;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const long long e = 4 * e4 + q;
            if (e < nh) router[e] = values[q];
            else norm[e - nh] = values[q];
        }
    }
    // Entry c of dP | dQ.
    __device__ __forceinline__ void store_coef_grad(const int c, const double sum) const {
        if (c < N * N * N) pred[c] = static_cast<float>(sum);
        else corr[c - N * N * N] = static_cast<float>(sum);
    }
};
