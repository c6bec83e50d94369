"""CPU: the step-by-step float64 reference of the predict-correct backward against torch.autograd,
its intermediates, a mirror of the fused v2 kernel's algebra (three reduction rounds), and the
one-reduction formulation that kernel v3 computes."""

from __future__ import annotations

import pytest
import torch

from altup_cupy.reference import (
    predict_correct_autograd,
    predict_correct_backward_one_reduction,
    predict_correct_backward_reference,
    predict_correct_backward_stages,
    predict_correct_forward,
)
from altup_cupy.lab.workloads import Workload, predict_correct_backward_inputs

CASES = [  # N, H, active_idx, norm_weight, B, S
    (3, 40, 0, "ones", 2, 3),
    (3, 40, 2, "random", 1, 5),
    (2, 64, 1, "random", 2, 2),
    (2, 8, 0, "ones", 1, 1),
    (4, 48, 3, "random", 2, 3),
    (4, 24, 1, "ones", 3, 1),
    (3, 2304, 1, "random", 1, 2),
]


def _inputs(n, h, a, nw, b, s, seed=0):
    w = Workload("predict_correct_backward", n, h, b, s, 0.0, 0.0, 1e-6, a)
    inputs = predict_correct_backward_inputs(w, seed, "cpu", nw)
    # larger router weights than the benchmark's so tanh is visibly non-linear
    inputs["router_weight"] = (inputs["router_weight"].float() * 20).to(torch.bfloat16)
    return inputs


def _rel(x, y):
    return ((x - y).norm() / y.norm().clamp_min(1e-300)).item()


# The step-by-step reference, and the same math reorganised as kernel v3 computes it (every
# per-token reduction from one set of dot products of the raw rows).
FORMULATIONS = [predict_correct_backward_reference, predict_correct_backward_one_reduction]


@pytest.mark.parametrize("formulation", FORMULATIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("n,h,a,nw,b,s", CASES)
def test_reference_matches_autograd(n, h, a, nw, b, s, formulation):
    inputs = _inputs(n, h, a, nw, b, s)
    ref = formulation(**inputs)
    auto = predict_correct_autograd(**inputs)
    for name, r, g in zip(ref._fields, ref, auto):
        assert r.shape == g.shape, name
        assert r.dtype == torch.float64
        assert g.abs().max() > 0, f"{name} is identically zero: the test would prove nothing"
        assert _rel(r, g) < 1e-10, (name, _rel(r, g))


def test_reference_float32_close_to_float64():
    inputs = _inputs(3, 256, 0, "random", 2, 4)
    r64 = predict_correct_backward_reference(**inputs)
    r32 = predict_correct_backward_reference(**inputs, dtype=torch.float32)
    for x, y in zip(r32, r64):
        assert x.dtype == torch.float32
        assert _rel(x.double(), y) < 1e-4


def test_stages_are_consistent():
    n, h, a = 3, 40, 1
    inputs = _inputs(n, h, a, "random", 2, 3)
    st = predict_correct_backward_stages(**inputs)
    x = inputs["activated"].double()
    hs = inputs["hidden_states"].double()
    g = inputs["grad_corrected"].double()
    # forward statistics
    assert torch.allclose(st.r_c, torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6))
    assert torch.allclose(st.delta, x - st.pred[a])
    corrected = predict_correct_forward(hs, x, inputs["prediction_coefs"], inputs["correction_coefs"],
                                        inputs["router_weight"], inputs["norm_weight"], a, 1e-6)
    assert torch.allclose(corrected, st.pred + st.k.permute(2, 0, 1).unsqueeze(-1) * st.delta)
    # gd, gk, gpred
    assert torch.allclose(st.gd, (st.k.permute(2, 0, 1).unsqueeze(-1) * g).sum(0))
    assert torch.allclose(st.gk[..., 0], (g[0] * st.delta).sum(-1))
    assert torch.allclose(st.gpred[a], g[a] - st.gd)
    assert torch.allclose(st.gpred[(a + 1) % n], g[(a + 1) % n])
    # router backward identity: <gx, x> = r <gu, x> (1 - r^2 mean(x^2)) ~ eps-sized
    assert torch.allclose(st.s_c, (st.gu_c * x).sum(-1, keepdim=True))
    assert torch.allclose(st.grad_activated, st.gd + st.gx_c)


def v2_mirror(grad_corrected, hidden_states, activated, prediction_coefs, correction_coefs,
              router_weight, norm_weight, active_idx=0, eps=1e-6, dtype=torch.float64):
    """The fused v2 kernel's algebra, token-vectorized: the same three reduction rounds and the
    same formulas as predict_correct_backward_v2 (kernels/predict_correct_backward_v2.cu)."""
    n, b, s, h = grad_corrected.shape
    A = active_idx
    g = grad_corrected.to(dtype).reshape(n, -1, h)
    hs = hidden_states.to(dtype).reshape(n, -1, h)
    x = activated.to(dtype).reshape(-1, h)
    P, Q = prediction_coefs.to(dtype), correction_coefs.to(dtype)
    R, w = router_weight.to(dtype), norm_weight.to(dtype)
    inv_h = 1.0 / h
    ha = hs[A]
    # round 1: sum h_a^2, sum act^2, sum R_n w h_a, sum R_n w act
    r1_hh, r1_xx = (ha * ha).sum(-1), (x * x).sum(-1)
    r1_zp, r1_zc = (ha * w) @ R.T, (x * w) @ R.T
    r_p = 1.0 / torch.sqrt(r1_hh * inv_h + eps)
    r_c = 1.0 / torch.sqrt(r1_xx * inv_h + eps)
    m_p = torch.tanh(r1_zp * (r_p * inv_h)[:, None])
    m_c = torch.tanh(r1_zc * (r_c * inv_h)[:, None])
    C = m_p @ P.T  # [M, N*N]
    k = 1.0 + m_c @ Q.T
    Ca = C[:, A * n:(A + 1) * n].clone()
    Ca[:, A] += 1.0
    # round 2: gk_i = <g_i, delta>, dC_ij = <gpred_i, h_j>
    delta = x - torch.einsum("mj,jmh->mh", Ca, hs)
    gd = torch.einsum("mi,imh->mh", k, g)
    gk = torch.einsum("imh,mh->mi", g, delta)
    gpred = g.clone()
    gpred[A] -= gd
    dC = torch.einsum("imh,jmh->mij", gpred, hs).reshape(-1, n * n)
    gz_c = (gk @ Q) * (1 - m_c * m_c)
    gz_p = (dC @ P) * (1 - m_p * m_p)
    # round 3: r3 = sum gxn w x
    gxn_p, gxn_c = gz_p @ R, gz_c @ R
    r3_p, r3_c = (gxn_p * w * ha).sum(-1), (gxn_c * w * x).sum(-1)
    coef_p = (r_p ** 3 * r3_p * inv_h * inv_h)[:, None]
    coef_c = (r_c ** 3 * r3_c * inv_h * inv_h)[:, None]
    rp_h, rc_h = (r_p * inv_h)[:, None], (r_c * inv_h)[:, None]
    gx_p = rp_h * gxn_p * w - coef_p * ha
    gx_c = rc_h * gxn_c * w - coef_c * x
    xn_p, xn_c = ha * rp_h * w, x * rc_h * w
    dR = gz_p.T @ xn_p + gz_c.T @ xn_c
    dw = (gxn_p * ha * rp_h + gxn_c * x * rc_h).sum(0)
    grad_h = gpred + torch.einsum("mij,imh->jmh", C.reshape(-1, n, n), gpred)
    grad_h[A] += gx_p
    grad_x = gd + gx_c
    dP = dC.T @ m_p
    dQ = gk.T @ m_c
    return (grad_h.reshape(n, b, s, h), grad_x.reshape(b, s, h), dP, dQ, dR, dw)


@pytest.mark.parametrize("n,h,a,nw,b,s", CASES)
def test_v2_algebra_matches_reference(n, h, a, nw, b, s):
    inputs = _inputs(n, h, a, nw, b, s)
    ref = predict_correct_backward_reference(**inputs)
    mirror = v2_mirror(**inputs)
    for name, r, m in zip(ref._fields, ref, mirror):
        assert _rel(m, r) < 1e-10, (name, _rel(m, r))
