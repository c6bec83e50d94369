"""Gemma 3n's four AltUp steps as separate autograd nodes, forward and backward, in plain PyTorch.

In the model the decoder layer reads the active prediction and returns `activated`, so predict
and correct are two nodes with the layer's backward between them (docs/GEMMA3N.md). Shapes: streams
[N, B, S, H], rows [B, S, H]; R = router_weight [N, H], w = norm_weight [H], P [N*N, N], Q [N, N].

    route(x)      = tanh(R @ (x * rsqrt(mean(x^2) + eps) * w * s))     s = router_scale, 1 / H
    predict:  m_p = route(h_a);  C[i][j] = (P @ m_p)[N*i + j];  pred_i = h_i + sum_j C[i][j] h_j
    correct:  m_c = route(x);    k = Q @ m_c + 1;               corrected_i = pred_i + k_i (x - pred_a)
    magnitude match (expansion and collapse): for a base row b and projections p_k = s_k @ W_k^T,
              t = sqrt(mean(b^2)),  n_k = sqrt(max(mean(p_k^2), floor)),  q_k = p_k * t / n_k
    expand:   streams = stack(x0, q_1 .. q_{N-1})            (b = x0, s_k = x0)
    collapse: out = (s_0 + sum_k q_k) / N                    (b = s_0, s_k = streams[k])

Backward of the magnitude match, with upstream gradient g_k of q_k (the derivation of the
kernels; checked against autograd in tests/test_gemma3n_reference.py):

    gp_k   = (t / n_k) g_k - [mean(p_k^2) >= floor] * t <g_k, p_k> p_k / (H n_k^3)
    grad b = (sum_k <g_k, p_k> / n_k) * b / (H t)       (+ whatever b receives directly)
    grad s_k = gp_k @ W_k,   grad W_k = gp_k^T s_k      (over all tokens)

The router backward and the per-step backwards follow `reference.predict_correct`'s notation.
The router scale s is transformers' `router_input_scale` buffer: 1 / H, rounded to the model's
dtype (in bf16, 1/2560 becomes 1.00098 / 2560); None means exactly 1 / H.
Every function computes in `dtype` (float64: the references; float32: the plain implementation
the custom operators run on CPU) and returns results in `dtype`.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch


# transformers hard-codes this floor on the mean square of the expansion and collapse
# projections (it is not rms_norm_eps).
MAGNITUDE_FLOOR = 1e-5


class RouterGrads(NamedTuple):
    grad_input: torch.Tensor  # [.., H]
    grad_router_weight: torch.Tensor  # [N, H]
    grad_norm_weight: torch.Tensor  # [H]


class PredictGrads(NamedTuple):
    grad_hidden_states: torch.Tensor  # [N, B, S, H]
    grad_prediction_coefs: torch.Tensor  # [N*N, N]
    grad_router_weight: torch.Tensor  # [N, H]
    grad_norm_weight: torch.Tensor  # [H]


class CorrectGrads(NamedTuple):
    grad_predictions: torch.Tensor  # [N, B, S, H]
    grad_activated: torch.Tensor  # [B, S, H]
    grad_correction_coefs: torch.Tensor  # [N, N]
    grad_router_weight: torch.Tensor  # [N, H]
    grad_norm_weight: torch.Tensor  # [H]


class MagnitudeMatchGrads(NamedTuple):
    grad_projected: torch.Tensor  # [N-1, B, S, H]  gp_k, the gradient reaching p_k
    grad_base: torch.Tensor  # [B, S, H]  the gradient reaching b through t only


class ProjectionGrads(NamedTuple):
    grad_input: torch.Tensor  # expand: [B, S, H] (x0); collapse: [N, B, S, H] (streams)
    grad_projections: torch.Tensor  # [N-1, H, H]


def _tokens(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _scale(x, router_scale):
    return 1.0 / x.shape[-1] if router_scale is None else router_scale


def route(x, router_weight, norm_weight, eps, router_scale=None):
    """route(x) and its intermediates: r [.., 1], u = x r, xn = u w s, m [.., N]."""
    r = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)
    u = x * r
    xn = u * norm_weight * _scale(x, router_scale)
    return r, u, xn, torch.tanh(xn @ router_weight.T)


def route_backward(x, grad_modalities, router_weight, norm_weight, eps, router_scale=None) -> RouterGrads:
    """The gradients of <grad_modalities, route(x)> with respect to x, R and w."""
    hidden, scale = x.shape[-1], _scale(x, router_scale)
    r, u, xn, m = route(x, router_weight, norm_weight, eps, router_scale)
    gz = grad_modalities * (1.0 - m.square())  # through tanh
    gxn = gz @ router_weight
    gu = gxn * norm_weight * scale
    s = (gu * x).sum(dim=-1, keepdim=True)  # the rsqrt's share
    grad_x = r * gu - r.pow(3) * x * s / hidden
    grad_R = _tokens(gz).T @ _tokens(xn)
    grad_w = _tokens(gxn * u).sum(dim=0) * scale
    return RouterGrads(grad_x, grad_R, grad_w)


def _prediction_matrix(hidden_states, prediction_coefs, router_weight, norm_weight, active_idx, eps,
                       router_scale):
    """m_p [B, S, N] and C [B, S, N(i), N(j)]."""
    streams = hidden_states.shape[0]
    *_, m_p = route(hidden_states[active_idx], router_weight, norm_weight, eps, router_scale)
    return m_p, (m_p @ prediction_coefs.T).unflatten(-1, (streams, streams))


def _cast(dtype, *tensors):
    return [t.to(dtype) for t in tensors]


def predict_forward(hidden_states, prediction_coefs, router_weight, norm_weight,
                    active_idx: int = 0, eps: float = 1e-6, dtype=torch.float64,
                    router_scale: float | None = None) -> torch.Tensor:
    """pred [N, B, S, H] in `dtype`; differentiable."""
    h, P, R, w = _cast(dtype, hidden_states, prediction_coefs, router_weight, norm_weight)
    _, C = _prediction_matrix(h, P, R, w, active_idx, eps, router_scale)
    return h + torch.einsum("bsij,jbsh->ibsh", C, h)


def predict_backward(grad_predictions, hidden_states, prediction_coefs, router_weight, norm_weight,
                     active_idx: int = 0, eps: float = 1e-6, dtype=torch.float64,
                     router_scale: float | None = None) -> PredictGrads:
    """Step by step: dC_ij = <g_i, h_j>; grad_h_j = g_j + sum_i C_ij g_i (+ the router's share
    at j = a, upstream gm_p = P^T dC); dP[N*i+j, l] = sum_t dC_ij m_p,l."""
    g, h, P, R, w = _cast(dtype, grad_predictions, hidden_states, prediction_coefs,
                          router_weight, norm_weight)
    a = active_idx
    m_p, C = _prediction_matrix(h, P, R, w, a, eps, router_scale)
    dC = torch.einsum("ibsh,jbsh->bsij", g, h)
    grad_m_p = dC.flatten(-2) @ P
    router = route_backward(h[a], grad_m_p, R, w, eps, router_scale)
    grad_h = g + torch.einsum("bsij,ibsh->jbsh", C, g)
    grad_h[a] = grad_h[a] + router.grad_input
    grad_P = _tokens(dC.flatten(-2)).T @ _tokens(m_p)
    return PredictGrads(grad_h, grad_P, router.grad_router_weight, router.grad_norm_weight)


def correct_forward(predictions, activated, correction_coefs, router_weight, norm_weight,
                    active_idx: int = 0, eps: float = 1e-6, dtype=torch.float64,
                    router_scale: float | None = None) -> torch.Tensor:
    """corrected [N, B, S, H] in `dtype`; differentiable."""
    pred, x, Q, R, w = _cast(dtype, predictions, activated, correction_coefs, router_weight, norm_weight)
    *_, m_c = route(x, R, w, eps, router_scale)
    k = m_c @ Q.T + 1.0  # [B, S, N]
    innovation = x - pred[active_idx]
    return pred + k.permute(2, 0, 1).unsqueeze(-1) * innovation


def correct_backward(grad_corrected, predictions, activated, correction_coefs, router_weight,
                     norm_weight, active_idx: int = 0, eps: float = 1e-6,
                     dtype=torch.float64, router_scale: float | None = None) -> CorrectGrads:
    """Step by step: gd = sum_i k_i g_i; gk_i = <g_i, x - pred_a>; grad_pred_i = g_i - [i==a] gd;
    grad_x = gd + the router's share (upstream Q^T gk); dQ = sum_t gk m_c^T."""
    g, pred, x, Q, R, w = _cast(dtype, grad_corrected, predictions, activated, correction_coefs,
                                router_weight, norm_weight)
    a = active_idx
    *_, m_c = route(x, R, w, eps, router_scale)
    k = m_c @ Q.T + 1.0
    innovation = x - pred[a]
    gd = torch.einsum("bsi,ibsh->bsh", k, g)
    gk = torch.einsum("ibsh,bsh->bsi", g, innovation)
    router = route_backward(x, gk @ Q, R, w, eps, router_scale)
    grad_pred = g.clone()
    grad_pred[a] = grad_pred[a] - gd
    grad_Q = _tokens(gk).T @ _tokens(m_c)
    return CorrectGrads(grad_pred, gd + router.grad_input, grad_Q, router.grad_router_weight,
                        router.grad_norm_weight)


def _magnitudes(base, projected, floor):
    """t [B, S, 1] and n_k [N-1, B, S, 1], with the clamp's mask [N-1, B, S, 1]."""
    target = base.square().mean(dim=-1, keepdim=True).sqrt()
    mean_square = projected.square().mean(dim=-1, keepdim=True)
    return target, mean_square.clamp_min(floor).sqrt(), mean_square >= floor


def magnitude_match_forward(base, projected, floor: float = MAGNITUDE_FLOOR) -> torch.Tensor:
    """q_k = p_k * t / n_k, [N-1, B, S, H], in the inputs' dtype."""
    target, norm, _ = _magnitudes(base, projected, floor)
    return projected * (target / norm)


def magnitude_match_backward(grad_matched, base, projected,
                             floor: float = MAGNITUDE_FLOOR) -> MagnitudeMatchGrads:
    """gp_k and the gradient reaching b through t (module docstring), in the inputs' dtype."""
    hidden = base.shape[-1]
    target, norm, unclamped = _magnitudes(base, projected, floor)
    dot = (grad_matched * projected).sum(dim=-1, keepdim=True)  # <g_k, p_k>
    grad_projected = (target / norm) * grad_matched - unclamped * target * dot * projected / (hidden * norm.pow(3))
    grad_base = (dot / norm).sum(dim=0) * base / (hidden * target)
    return MagnitudeMatchGrads(grad_projected, grad_base)


def _project(inputs, projections):
    """p_k = inputs_k @ W_k^T for k = 1 .. N-1, stacked: [N-1, B, S, H]."""
    return torch.stack([x @ W.T for x, W in zip(inputs, projections)])


def expand_forward(embeddings, projections: Sequence[torch.Tensor] | torch.Tensor,
                   floor: float = MAGNITUDE_FLOOR, dtype=torch.float64) -> torch.Tensor:
    """streams [N, B, S, H]: stream 0 = embeddings, stream k = magnitude-matched x0 @ W_k^T."""
    x0 = embeddings.to(dtype)
    W = [p.to(dtype) for p in projections]
    projected = _project([x0] * len(W), W)
    return torch.cat([x0.unsqueeze(0), magnitude_match_forward(x0, projected, floor)])


def expand_backward(grad_streams, embeddings, projections, floor: float = MAGNITUDE_FLOOR,
                    dtype=torch.float64) -> ProjectionGrads:
    g, x0 = grad_streams.to(dtype), embeddings.to(dtype)
    W = [p.to(dtype) for p in projections]
    projected = _project([x0] * len(W), W)
    matched = magnitude_match_backward(g[1:], x0, projected, floor)
    grad_x0 = g[0] + matched.grad_base + sum(gp @ Wk for gp, Wk in zip(matched.grad_projected, W))
    grad_W = torch.stack([_tokens(gp).T @ _tokens(x0) for gp in matched.grad_projected])
    return ProjectionGrads(grad_x0, grad_W)


def collapse_forward(streams, projections, floor: float = MAGNITUDE_FLOOR,
                     dtype=torch.float64) -> torch.Tensor:
    """out [B, S, H] = (s_0 + sum_k magnitude-matched s_k @ U_k^T) / N."""
    s = streams.to(dtype)
    U = [p.to(dtype) for p in projections]
    projected = _project(s[1:], U)
    return (s[0] + magnitude_match_forward(s[0], projected, floor).sum(dim=0)) / s.shape[0]


def collapse_backward(grad_output, streams, projections, floor: float = MAGNITUDE_FLOOR,
                      dtype=torch.float64) -> ProjectionGrads:
    s = streams.to(dtype)
    U = [p.to(dtype) for p in projections]
    g = grad_output.to(dtype) / s.shape[0]  # the mean's share, the same for every stream
    projected = _project(s[1:], U)
    matched = magnitude_match_backward(g.expand_as(projected), s[0], projected, floor)
    grad_s = torch.stack([g + matched.grad_base] + [gp @ Uk for gp, Uk in zip(matched.grad_projected, U)])
    grad_U = torch.stack([_tokens(gp).T @ _tokens(sk) for gp, sk in zip(matched.grad_projected, s[1:])])
    return ProjectionGrads(grad_s, grad_U)


# ---- the backwards as the kernels compute them ------------------------------------------------------
# One block reduction per token gives every dot product a step needs; the rest is per-token
# scalars and fixed linear maps of the rows (kernels/altup_predict_backward.cuh,
# altup_correct_backward.cuh and altup_rows.cuh follow these lines). Tested equal to the step-by-step backwards above.

def _router_scalars(ss, A, hidden, eps, scale):
    """r [.., 1] and m = tanh(r A s) [.., N] from ss = <x, x> and A_n = sum_d R_nd w_d x_d."""
    r = torch.rsqrt(ss / hidden + eps).unsqueeze(-1)
    return r, torch.tanh(r * A * scale)


def _router_backward_scalars(r, m, A, grad_m, hidden, scale):
    """gz, alpha = r gz s and beta = r^3 s <gz, A> / H (gx = w (R^T alpha) - beta x)."""
    gz = grad_m * (1.0 - m.square())
    return gz, r * gz * scale, r.pow(3) * scale * (gz * A).sum(-1, keepdim=True) / hidden


def predict_backward_one_reduction(grad_predictions, hidden_states, prediction_coefs, router_weight,
                                   norm_weight, active_idx: int = 0, eps: float = 1e-6, dtype=torch.float64,
                                   router_scale: float | None = None) -> PredictGrads:
    g, h, P, R, w = _cast(dtype, grad_predictions, hidden_states, prediction_coefs, router_weight, norm_weight)
    streams, hidden, a = h.shape[0], h.shape[-1], active_idx
    scale = _scale(h, router_scale)
    eye = torch.eye(streams, dtype=dtype)
    # the one reduction: <h_a, h_a>, A_n, G_ij = <g_i, h_j>
    ss, A = h[a].square().sum(-1), (h[a] * w) @ R.T
    G = torch.einsum("ibsh,jbsh->bsij", g, h)
    # per-token scalars
    r, m = _router_scalars(ss, A, hidden, eps, scale)
    C = (m @ P.T).unflatten(-1, (streams, streams))
    gz, alpha, beta = _router_backward_scalars(r, m, A, G.flatten(-2) @ P, hidden, scale)
    # rows: grad_h_j = sum_i (delta_ij + C_ij) g_i, plus w (R^T alpha) - beta h_a at j = a
    grad_h = torch.einsum("bsij,ibsh->jbsh", eye + C, g)
    grad_h[a] = grad_h[a] + w * (alpha @ R) - beta * h[a]
    # weight gradients: S = sum_t r gz h_a^T; dR = s w S, dw = s sum_n R_n S_n
    S = _tokens(r * gz).T @ _tokens(h[a])
    grad_P = _tokens(G.flatten(-2)).T @ _tokens(m)
    return PredictGrads(grad_h, grad_P, scale * w * S, scale * (R * S).sum(0))


def correct_backward_one_reduction(grad_corrected, predictions, activated, correction_coefs, router_weight,
                                   norm_weight, active_idx: int = 0, eps: float = 1e-6, dtype=torch.float64,
                                   router_scale: float | None = None) -> CorrectGrads:
    g, pred, x, Q, R, w = _cast(dtype, grad_corrected, predictions, activated, correction_coefs, router_weight,
                                norm_weight)
    hidden, a = x.shape[-1], active_idx
    scale = _scale(x, router_scale)
    # the one reduction: <x, x>, A_n, <g_i, x>, <g_i, pred_a>
    ss, A = x.square().sum(-1), (x * w) @ R.T
    gx_dot, gp_dot = torch.einsum("ibsh,bsh->bsi", g, x), torch.einsum("ibsh,bsh->bsi", g, pred[a])
    # per-token scalars
    r, m = _router_scalars(ss, A, hidden, eps, scale)
    k = m @ Q.T + 1.0
    gk = gx_dot - gp_dot
    gz, alpha, beta = _router_backward_scalars(r, m, A, gk @ Q, hidden, scale)
    # rows
    gd = torch.einsum("bsi,ibsh->bsh", k, g)
    grad_pred = g.clone()
    grad_pred[a] = grad_pred[a] - gd
    grad_x = gd + w * (alpha @ R) - beta * x
    # weight gradients
    S = _tokens(r * gz).T @ _tokens(x)
    grad_Q = _tokens(gk).T @ _tokens(m)
    return CorrectGrads(grad_pred, grad_x, grad_Q, scale * w * S, scale * (R * S).sum(0))
