// magnitude_match_grads.cuh: the magnitude match around the projection GEMMs of Gemma 3n's stream
// expansion (model input) and collapse (model output), and the per-token scalars of its backward,
// shared by the backward's versions.
//
// For a base row b and projections p_k (k = 1 .. N-1, fp32 GEMM outputs, never rounded):
//   t = sqrt(mean(b^2)),  n_k = sqrt(max(mean(p_k^2), floor)),  q_k = p_k t / n_k
// Expansion forward (altup_expand_forward_v1.cu): streams = (b, q_1 .. q_{N-1}) with b = the
// embeddings. Backward (expansion and collapse), upstream g_k of q_k (scaled by `grad_scale`):
//   gp_k   = (t / n_k) g_k - [mean(p_k^2) >= floor] t <g_k, p_k> p_k / (H n_k^3)
//   grad_b = g_0 + (sum_k <g_k, p_k> / n_k) b / (H t)
// Expansion: g_k = grad_streams[k], scale 1; its grad_b still needs + sum_k gp_k W_k (a GEMM), so
// it is written in fp32. Collapse (out = (s_0 + sum_k q_k) / N): every g_k is grad_out (stream
// stride 0), scale 1 / N, and grad_b is the final bf16 gradient of stream 0. The projections and
// their gradients share one layout: element (k, t, d) at k * proj_stride_k + t * proj_stride_t + d.
//
// From the block sums of projection k,
// sum_pp = <p_k, p_k> and sum_gp = <g_k, p_k>, and the base row's root mean square t:
//   gp_k = direct g_k - through_norm p_k, and base_term is projection k's share of grad_b's
//   coefficient before the final * inv_h / t.
#pragma once

struct MatchGradScalars {
    float direct, through_norm, base_term;
    __device__ __forceinline__ MatchGradScalars(const float sum_pp, const float sum_gp, const float target,
                                                const float grad_scale, const float inv_h, const float floor) {
        const float mean_square = sum_pp * inv_h;
        const float norm = sqrtf(fmaxf(mean_square, floor));
        const float dot = grad_scale * sum_gp;
        direct = grad_scale * target / norm;
        through_norm = mean_square >= floor ? target * dot * inv_h / (norm * norm * norm) : 0.0f;
        base_term = dot / norm;
    }
};
