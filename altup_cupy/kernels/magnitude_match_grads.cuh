// magnitude_match_grads.cuh: the per-token scalars of the magnitude match's backward, shared by its
// versions (altup_magnitude_match_v1.cu has the math). From the block sums of projection k,
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
