"""The AltUp predict + correct step (docs/SPEC.md section 2) and its backward, in plain PyTorch.

Forward, per token t (h_j = hidden_states[j, t], x = activated[t], a = active_idx):

    route(x)    = tanh(R @ (x * rsqrt(mean(x^2) + eps) * w / H))      R = router_weight [N, H]
    m_p         = route(h_a);  c = P @ m_p;  C[i][j] = c[N*i + j]     P = prediction_coefs [N*N, N]
    pred_i      = h_i + sum_j C[i][j] h_j
    m_c         = route(x);    k = Q @ m_c + 1                        Q = correction_coefs [N, N]
    delta       = x - pred_a
    corrected_i = pred_i + k_i * delta

Backward, with g_i = grad_corrected[i, t] (every name below is a field of `BackwardStages`):

    route backward, upstream gm (for input x with r = rsqrt(mean(x^2)+eps), u = x*r, xn = u*w/H,
    m = tanh(R xn)):
        gz = gm * (1 - m^2);  dR += gz (x) xn;  gxn = R^T gz;  dw += gxn * u / H
        gu = gxn * w / H;     gx = r * gu - r^3 * x * <gu, x> / H

    gd       = sum_i k_i g_i                      (gradient reaching delta)
    gk_i     = <g_i, delta>                       (correction coefficient gradients)
    dQ       = sum_t gk (x) m_c;   gm_c = Q^T gk
    gpred_i  = g_i - [i == a] gd                  (gradient reaching pred_i)
    dC_ij    = <gpred_i, h_j>;     dP[N*i + j, l] = sum_t dC_ij m_p_l;   gm_p = P^T dC
    grad_h_j = gpred_j + sum_i C_ij gpred_i + [j == a] route_bwd(h_a, gm_p)
    grad_x   = gd + route_bwd(x, gm_c)

The weight gradients sum over all tokens and over both uses of route().

In float64 these functions are the references every kernel is checked against; in float32 they
are the plain PyTorch implementation (eager baseline, accuracy oracle). They run on any device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


class PredictCorrectGrads(NamedTuple):
    """The six gradients of the predict-correct backward, in the caller's array type (torch
    tensors or CuPy arrays). The kernels return bf16 activation gradients and fp32 weight
    gradients; the references return their computation dtype."""

    grad_hidden_states: Any  # [N, B, S, H]
    grad_activated: Any  # [B, S, H]
    grad_prediction_coefs: Any  # [N*N, N]
    grad_correction_coefs: Any  # [N, N]
    grad_router_weight: Any  # [N, H]
    grad_norm_weight: Any  # [H]


def _route(x, router_weight, norm_weight, eps):
    """route(x) and its intermediates: r [.., 1], u, xn [.., H], z, m [.., N]."""
    hidden = x.shape[-1]
    r = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)
    u = x * r
    xn = u * norm_weight / hidden
    z = xn @ router_weight.T
    m = torch.tanh(z)
    return r, u, xn, z, m


def predict_correct_forward(hidden_states, activated, prediction_coefs, correction_coefs,
                            router_weight, norm_weight, active_idx: int = 0, eps: float = 1e-6,
                            dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """corrected [N, B, S, H] in `dtype`, differentiable with respect to every tensor input."""
    streams = hidden_states.shape[0]
    h = hidden_states.to(dtype)
    x = activated.to(dtype)
    P, Q = prediction_coefs.to(dtype), correction_coefs.to(dtype)
    R, w = router_weight.to(dtype), norm_weight.to(dtype)
    a = active_idx
    _, _, _, _, m_p = _route(h[a], R, w, eps)
    C = (m_p @ P.T).unflatten(-1, (streams, streams))  # [B, S, N(i), N(j)]
    pred = h + torch.einsum("bsij,jbsh->ibsh", C, h)
    _, _, _, _, m_c = _route(x, R, w, eps)
    k = m_c @ Q.T + 1.0  # [B, S, N]
    delta = x - pred[a]
    return pred + k.permute(2, 0, 1).unsqueeze(-1) * delta


@dataclass
class BackwardStages:
    """Every intermediate of the backward, named as in the derivation (per token unless noted).

    Shapes: T = [B, S]; rows are [.., H], per-stream rows [N, .., H].
    """

    # forward statistics and router outputs
    r_p: torch.Tensor  # T+[1]  rsqrt(mean(h_a^2) + eps)
    u_p: torch.Tensor  # T+[H]  h_a * r_p
    xn_p: torch.Tensor  # T+[H] u_p * w / H
    m_p: torch.Tensor  # T+[N]  route(h_a)
    C: torch.Tensor  # T+[N, N]  prediction coefficients C[i][j]
    pred: torch.Tensor  # [N]+T+[H]
    r_c: torch.Tensor  # T+[1]
    u_c: torch.Tensor  # T+[H]
    xn_c: torch.Tensor  # T+[H]
    m_c: torch.Tensor  # T+[N]  route(activated)
    k: torch.Tensor  # T+[N]  Q m_c + 1
    delta: torch.Tensor  # T+[H]  activated - pred_a
    # correction-coefficient gradients
    gd: torch.Tensor  # T+[H]  sum_i k_i g_i
    gk: torch.Tensor  # T+[N]  <g_i, delta>
    # correct-step router backward
    gm_c: torch.Tensor  # T+[N]  Q^T gk
    gz_c: torch.Tensor  # T+[N]  gm_c (1 - m_c^2)
    gxn_c: torch.Tensor  # T+[H]  R^T gz_c
    gu_c: torch.Tensor  # T+[H]  gxn_c * w / H
    s_c: torch.Tensor  # T+[1]  <gu_c, activated>
    gx_c: torch.Tensor  # T+[H]  r_c gu_c - r_c^3 activated s_c / H
    # prediction-coefficient gradients
    gpred: torch.Tensor  # [N]+T+[H]  g_i - [i==a] gd
    dC: torch.Tensor  # T+[N, N]  <gpred_i, h_j>
    # predict-step router backward
    gm_p: torch.Tensor  # T+[N]  P^T dC (dC flattened to N*N)
    gz_p: torch.Tensor  # T+[N]
    gxn_p: torch.Tensor  # T+[H]
    gu_p: torch.Tensor  # T+[H]
    s_p: torch.Tensor  # T+[1]  <gu_p, h_a>
    gx_p: torch.Tensor  # T+[H]
    # element-wise gradients
    grad_hidden_states: torch.Tensor  # [N]+T+[H]
    grad_activated: torch.Tensor  # T+[H]
    # weight-gradient reductions (sums over tokens)
    grad_prediction_coefs: torch.Tensor  # [N*N, N]
    grad_correction_coefs: torch.Tensor  # [N, N]
    grad_router_weight: torch.Tensor  # [N, H]
    grad_norm_weight: torch.Tensor  # [H]

    def grads(self) -> PredictCorrectGrads:
        return PredictCorrectGrads(self.grad_hidden_states, self.grad_activated,
                                      self.grad_prediction_coefs, self.grad_correction_coefs,
                                      self.grad_router_weight, self.grad_norm_weight)


def predict_correct_backward_stages(grad_corrected, hidden_states, activated, prediction_coefs,
                                    correction_coefs, router_weight, norm_weight,
                                    active_idx: int = 0, eps: float = 1e-6,
                                    dtype: torch.dtype = torch.float64) -> BackwardStages:
    """The backward step by step, returning every intermediate (see the module docstring)."""
    streams, hidden = hidden_states.shape[0], hidden_states.shape[-1]
    a = active_idx
    g = grad_corrected.to(dtype)  # [N, B, S, H]
    h = hidden_states.to(dtype)
    x = activated.to(dtype)
    P, Q = prediction_coefs.to(dtype), correction_coefs.to(dtype)
    R, w = router_weight.to(dtype), norm_weight.to(dtype)

    # 1. forward statistics and router outputs
    r_p, u_p, xn_p, _, m_p = _route(h[a], R, w, eps)
    C = (m_p @ P.T).unflatten(-1, (streams, streams))  # C[.., i, j] = c[N*i + j]
    pred = h + torch.einsum("bsij,jbsh->ibsh", C, h)
    r_c, u_c, xn_c, _, m_c = _route(x, R, w, eps)
    k = m_c @ Q.T + 1.0
    delta = x - pred[a]

    # 2. correction-coefficient gradients
    gd = torch.einsum("bsi,ibsh->bsh", k, g)
    gk = torch.einsum("ibsh,bsh->bsi", g, delta)

    # 3. correct-step router backward
    gm_c = gk @ Q
    gz_c = gm_c * (1.0 - m_c.square())
    gxn_c = gz_c @ R
    gu_c = gxn_c * w / hidden
    s_c = (gu_c * x).sum(dim=-1, keepdim=True)
    gx_c = r_c * gu_c - r_c.pow(3) * x * s_c / hidden

    # 4. prediction-coefficient gradients
    gpred = g.clone()
    gpred[a] = gpred[a] - gd
    dC = torch.einsum("ibsh,jbsh->bsij", gpred, h)

    # 5. predict-step router backward
    gm_p = dC.flatten(-2) @ P
    gz_p = gm_p * (1.0 - m_p.square())
    gxn_p = gz_p @ R
    gu_p = gxn_p * w / hidden
    s_p = (gu_p * h[a]).sum(dim=-1, keepdim=True)
    gx_p = r_p * gu_p - r_p.pow(3) * h[a] * s_p / hidden

    # 6. element-wise gradients
    grad_h = gpred + torch.einsum("bsij,ibsh->jbsh", C, gpred)
    grad_h[a] = grad_h[a] + gx_p
    grad_x = gd + gx_c

    # 7. weight-gradient reductions over every token, through both uses of route()
    tokens = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    grad_P = tokens(dC.flatten(-2)).T @ tokens(m_p)
    grad_Q = tokens(gk).T @ tokens(m_c)
    grad_R = tokens(gz_p).T @ tokens(xn_p) + tokens(gz_c).T @ tokens(xn_c)
    grad_w = (tokens(gxn_p * u_p).sum(dim=0) + tokens(gxn_c * u_c).sum(dim=0)) / hidden

    return BackwardStages(r_p, u_p, xn_p, m_p, C, pred, r_c, u_c, xn_c, m_c, k, delta, gd, gk,
                          gm_c, gz_c, gxn_c, gu_c, s_c, gx_c, gpred, dC, gm_p, gz_p, gxn_p, gu_p,
                          s_p, gx_p, grad_h, grad_x, grad_P, grad_Q, grad_R, grad_w)


def predict_correct_backward_reference(grad_corrected, hidden_states, activated, prediction_coefs,
                                       correction_coefs, router_weight, norm_weight,
                                       active_idx: int = 0, eps: float = 1e-6,
                                       dtype: torch.dtype = torch.float64) -> PredictCorrectGrads:
    """The six gradients of docs/SPEC.md section 2 in `dtype` (not rounded to the contract dtypes)."""
    return predict_correct_backward_stages(grad_corrected, hidden_states, activated,
                                           prediction_coefs, correction_coefs, router_weight,
                                           norm_weight, active_idx, eps, dtype).grads()


def predict_correct_autograd(grad_corrected, hidden_states, activated, prediction_coefs,
                             correction_coefs, router_weight, norm_weight, active_idx: int = 0,
                             eps: float = 1e-6, dtype: torch.dtype = torch.float64
                             ) -> PredictCorrectGrads:
    """The six gradients by torch.autograd through `predict_correct_forward` in `dtype`."""
    leaves = [t.detach().to(dtype).requires_grad_(True)
              for t in (hidden_states, activated, prediction_coefs, correction_coefs,
                        router_weight, norm_weight)]
    with torch.enable_grad():
        corrected = predict_correct_forward(*leaves, active_idx=active_idx, eps=eps, dtype=dtype)
        grads = torch.autograd.grad(corrected, leaves, grad_outputs=grad_corrected.to(dtype))
    return PredictCorrectGrads(*grads)


def predict_correct_backward_one_reduction(grad_corrected, hidden_states, activated,
                                           prediction_coefs, correction_coefs, router_weight,
                                           norm_weight, active_idx: int = 0, eps: float = 1e-6,
                                           dtype: torch.dtype = torch.float64
                                           ) -> PredictCorrectGrads:
    """The backward as kernel v3 computes it: ONE set of per-token dot products of the raw rows,
    then per-token scalars, then fixed linear maps of the rows (docs/SPEC.md section 2's math,
    reorganised; `predict_correct_backward_v3` in kernels/predict_correct_backward_v3.cu follows it
    line by line).

        ss_a = <h_a,h_a>, ss_c = <x,x>, Ap_n = sum_d R_nd w_d h_a,d, Ac_n = (same on x),
        G_ij = <g_i, h_j>, Gc_i = <g_i, x>
        gk_i = Gc_i - G_ia - sum_j C_aj G_ij          (= <g_i, delta>)
        dC_ij = G_ij - [i==a] sum_l k_l G_lj          (= <gpred_i, h_j>)
        <gu_p, h_a> = sum_n gz_p,n Ap_n / H,  <gu_c, x> = sum_n gz_c,n Ac_n / H
        grad_h_j = sum_l B_jl g_l + [j==a] gx_p,  B_jl = (d_lj + C_lj) - (d_aj + C_aj) k_l
        grad_x   = sum_l k_l g_l + gx_c,          gx = w (R^T alpha) - beta x,
        alpha = r gz / H,  beta = r^3 <gu, x> / H
        S_nd = sum_t r_p gz_p,n h_a,d + r_c gz_c,n x_d;  dR = w S / H,  dw = sum_n R_n S_n / H
    """
    streams, hidden = hidden_states.shape[0], hidden_states.shape[-1]
    a = active_idx
    g, h, x = grad_corrected.to(dtype), hidden_states.to(dtype), activated.to(dtype)
    P, Q = prediction_coefs.to(dtype), correction_coefs.to(dtype)
    R, w = router_weight.to(dtype), norm_weight.to(dtype)
    eye = torch.eye(streams, dtype=dtype, device=g.device)

    # the one reduction: 2 + 3N + N^2 dot products per token
    ss_a, ss_c = h[a].square().sum(-1), x.square().sum(-1)  # T
    Ap, Ac = (h[a] * w) @ R.T, (x * w) @ R.T  # T+[N]
    G = torch.einsum("ibsh,jbsh->bsij", g, h)  # T+[N, N]
    Gc = torch.einsum("ibsh,bsh->bsi", g, x)  # T+[N]

    # per-token scalars
    r_p = torch.rsqrt(ss_a / hidden + eps).unsqueeze(-1)  # T+[1]
    r_c = torch.rsqrt(ss_c / hidden + eps).unsqueeze(-1)
    m_p, m_c = torch.tanh(r_p * Ap / hidden), torch.tanh(r_c * Ac / hidden)
    C = (m_p @ P.T).unflatten(-1, (streams, streams))
    k = m_c @ Q.T + 1.0
    gk = Gc - G[..., a] - torch.einsum("bsj,bsij->bsi", C[..., a, :], G)
    gd_h = torch.einsum("bsl,bslj->bsj", k, G)
    dC = G - eye[a].view(streams, 1) * gd_h.unsqueeze(-2)
    gz_c = (gk @ Q) * (1.0 - m_c.square())
    gz_p = (dC.flatten(-2) @ P) * (1.0 - m_p.square())
    s_p = (gz_p * Ap).sum(-1, keepdim=True) / hidden  # <gu_p, h_a>
    s_c = (gz_c * Ac).sum(-1, keepdim=True) / hidden  # <gu_c, x>
    B = (eye + C.transpose(-1, -2)) - (eye[a] + C[..., a, :]).unsqueeze(-1) * k.unsqueeze(-2)
    alpha_p, alpha_c = r_p * gz_p / hidden, r_c * gz_c / hidden
    beta_p, beta_c = r_p.pow(3) * s_p / hidden, r_c.pow(3) * s_c / hidden

    # fixed linear maps of the rows
    gx_p = w * (alpha_p @ R) - beta_p * h[a]
    gx_c = w * (alpha_c @ R) - beta_c * x
    grad_h = torch.einsum("bsjl,lbsh->jbsh", B, g)
    grad_h[a] = grad_h[a] + gx_p
    grad_x = torch.einsum("bsl,lbsh->bsh", k, g) + gx_c

    # weight gradients
    tokens = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    S = tokens(r_p * gz_p).T @ tokens(h[a]) + tokens(r_c * gz_c).T @ tokens(x)  # [N, H]
    grad_P = tokens(dC.flatten(-2)).T @ tokens(m_p)
    grad_Q = tokens(gk).T @ tokens(m_c)
    return PredictCorrectGrads(grad_h, grad_x, grad_P, grad_Q, w * S / hidden, (R * S).sum(0) / hidden)
