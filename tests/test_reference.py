"""The float64 reference of the collapse (docs/SPEC.md section 1) and the tolerance rule (section 3).

`collapse_reference` (torch, batched matmuls) is checked against an independent numpy
formulation written per row with explicit loops; eps clamping is exercised on purpose; the
float32 version is within float32 rounding of float64; `tolerance_report` implements the
benchmark's rule exactly (99% boundary, NaN, Inf).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from altup_cupy.lab.workloads import MIN_MATCH_RATIO, tolerance_report
from altup_cupy.reference import collapse_reference


def collapse_rowwise_numpy(hs: np.ndarray, ws: list[np.ndarray], eps: float) -> np.ndarray:
    """docs/SPEC.md section 1 row by row, in numpy float64, sums written as explicit dot products."""
    n, b, s, h = hs.shape
    out = np.empty((b, s, h), dtype=np.float64)
    for bi in range(b):
        for si in range(s):
            s0 = hs[0, bi, si]
            target = math.sqrt(float(np.dot(s0, s0)) / h)
            acc = s0.copy()
            for k in range(1, n):
                x = hs[k, bi, si]
                # y[j] = sum_d x[d] * W[j, d]  (nn.Linear: y = x @ W^T)
                y = np.array([np.dot(ws[k - 1][j], x) for j in range(h)])
                mean_sq = float(np.dot(y, y)) / h
                magnitude = math.sqrt(mean_sq if mean_sq > eps else eps)
                acc = acc + y * (target / magnitude)
            out[bi, si] = acc / n
    return out


def _bf16_inputs(n, b, s, h, seed, weight_scale=1.0, stream_scales=None):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn((n, b, s, h), generator=g)
    if stream_scales is not None:
        hs = hs * torch.tensor(stream_scales, dtype=torch.float32).view(n, 1, 1, 1)
    ws = torch.randn((n - 1, h, h), generator=g) * weight_scale
    return hs.to(torch.bfloat16), ws.to(torch.bfloat16)


def _np64(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float64).numpy()


@pytest.mark.parametrize(
    "n,b,s,h",
    [(2, 1, 1, 8), (3, 1, 7, 40), (4, 2, 3, 16), (3, 1, 1, 64), (2, 3, 2, 24), (4, 1, 7, 8)],
)
def test_reference_matches_rowwise_numpy(n, b, s, h, seeds):
    hs, ws = _bf16_inputs(n, b, s, h, seeds())
    eps = 1e-5
    ref = collapse_reference(hs, ws, eps, dtype=torch.float64)
    assert ref.dtype == torch.float64 and tuple(ref.shape) == (b, s, h)
    expected = collapse_rowwise_numpy(_np64(hs), [_np64(w) for w in ws], eps)
    np.testing.assert_allclose(ref.numpy(), expected, rtol=1e-12, atol=1e-12)


def test_reference_accepts_list_and_stacked_weights(seeds):
    hs, ws = _bf16_inputs(3, 2, 5, 40, seeds())
    stacked = collapse_reference(hs, ws, 1e-5)
    listed = collapse_reference(hs, [ws[0], ws[1]], 1e-5)
    assert torch.equal(stacked, listed)


def test_eps_clamp_is_exercised(seeds):
    """Stream 1's projection is tiny (mean square << eps), stream 2's is not: the clamp must
    bind for stream 1 only, and both formulations must agree on the clamped value."""
    n, b, s, h = 3, 1, 4, 40
    eps = 1e-5
    hs, ws = _bf16_inputs(n, b, s, h, seeds(), stream_scales=[1.0, 1e-4, 1.0], weight_scale=0.05)
    hs64 = _np64(hs)
    ws64 = [_np64(w) for w in ws]
    y1 = np.einsum("bsd,jd->bsj", hs64[1], ws64[0])
    y2 = np.einsum("bsd,jd->bsj", hs64[2], ws64[1])
    assert (np.mean(y1**2, axis=-1) < eps / 100).all(), "stream 1 was meant to fall under eps"
    assert (np.mean(y2**2, axis=-1) > eps * 100).all(), "stream 2 was meant to stay above eps"

    ref = collapse_reference(hs, ws, eps).numpy()
    np.testing.assert_allclose(ref, collapse_rowwise_numpy(hs64, ws64, eps), rtol=1e-12, atol=1e-14)

    # The clamp matters: without it stream 1 would be scaled up to the target magnitude.
    target = np.sqrt(np.mean(hs64[0] ** 2, axis=-1, keepdims=True))
    mag2 = np.sqrt(np.mean(y2**2, axis=-1, keepdims=True))
    clamped = (hs64[0] + y1 * target / math.sqrt(eps) + y2 * target / mag2) / n
    unclamped = (hs64[0] + y1 * target / np.sqrt(np.mean(y1**2, axis=-1, keepdims=True))
                 + y2 * target / mag2) / n
    np.testing.assert_allclose(ref, clamped, rtol=1e-12, atol=1e-14)
    assert np.abs(ref - unclamped).max() > 1e-2


def test_zero_stream_and_large_eps(seeds):
    """A stream that projects to exactly zero gives mag = sqrt(eps), contributes nothing, and
    makes no NaN; a large eps clamps every stream."""
    hs, ws = _bf16_inputs(3, 1, 3, 16, seeds())
    hs[2] = 0
    ref = collapse_reference(hs, ws, 1e-5)
    assert torch.isfinite(ref).all()
    hs64, ws64 = _np64(hs), [_np64(w) for w in ws]
    np.testing.assert_allclose(ref.numpy(), collapse_rowwise_numpy(hs64, ws64, 1e-5), rtol=1e-12, atol=1e-14)
    big = collapse_reference(hs, ws, 1e6).numpy()
    np.testing.assert_allclose(big, collapse_rowwise_numpy(hs64, ws64, 1e6), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("n,h", [(3, 3072), (4, 2048), (2, 40)])
def test_float32_reference_within_float32_error(n, h, seeds):
    hs, ws = _bf16_inputs(n, 1, 16, h, seeds())
    ref64 = collapse_reference(hs, ws, 1e-5, dtype=torch.float64)
    ref32 = collapse_reference(hs, ws, 1e-5, dtype=torch.float32)
    assert ref32.dtype == torch.float32
    report = tolerance_report(ref32, ref64, atol=0.0, rtol=0.0)
    # fp32 dot products of length H: relative error ~ sqrt(H) * 2^-24 at most a few 1e-6.
    assert report.finite and report.rel_l2 < 1e-5, report
    # Rounded to bf16 once at the end, it passes the benchmark's rule easily.
    bf16 = tolerance_report(ref32.to(torch.bfloat16), ref64, atol=1e-5, rtol=0.05)
    assert bf16.passed and bf16.match_ratio > 0.999, bf16


# ---- tolerance_report: the benchmark's rule --------------------------------------------------


def _with_misses(total: int, misses: int) -> tuple[torch.Tensor, torch.Tensor]:
    ref = torch.full((total,), 2.0, dtype=torch.float64)
    out = ref.clone()
    out[:misses] = 2.0 + 1.0 + 1e-9  # bound is atol + rtol*|ref| = 0.5 + 0.25*2 = 1.0
    return out, ref


def test_rule_exactly_99_percent_passes():
    out, ref = _with_misses(1000, 10)
    r = tolerance_report(out, ref, atol=0.5, rtol=0.25)
    assert r.match_ratio == pytest.approx(0.99, abs=0) and r.finite
    assert MIN_MATCH_RATIO == 0.99
    assert r.passed


def test_rule_98_9_percent_fails():
    out, ref = _with_misses(1000, 11)
    r = tolerance_report(out, ref, atol=0.5, rtol=0.25)
    assert r.match_ratio == pytest.approx(0.989) and r.finite
    assert not r.passed


def test_rule_boundary_is_inclusive():
    ref = torch.tensor([2.0, -2.0], dtype=torch.float64)
    out = torch.tensor([3.0, -3.0], dtype=torch.float64)  # |diff| == 0.5 + 0.25*2 exactly
    assert tolerance_report(out, ref, atol=0.5, rtol=0.25).match_ratio == 1.0
    out_far = torch.tensor([3.0 + 1e-12, -3.0], dtype=torch.float64)
    assert tolerance_report(out_far, ref, atol=0.5, rtol=0.25).match_ratio == 0.5


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_rule_any_nan_or_inf_fails(bad):
    ref = torch.ones(10_000, dtype=torch.float64)
    out = ref.clone().to(torch.bfloat16)
    out[1234] = bad
    r = tolerance_report(out, ref, atol=1e-5, rtol=0.05)
    assert r.match_ratio >= 0.9999  # one element in 10,000: the ratio alone would pass
    assert not r.finite
    assert not r.passed


def test_rule_rel_l2_and_shape_check():
    ref = torch.tensor([3.0, 4.0], dtype=torch.float64)
    out = torch.tensor([3.0, 4.5], dtype=torch.float32)
    r = tolerance_report(out, ref, atol=0.0, rtol=0.0)
    assert r.rel_l2 == pytest.approx(0.5 / 5.0)
    assert r.match_ratio == 0.5
    with pytest.raises(ValueError, match="shape"):
        tolerance_report(torch.zeros(3), torch.zeros(2, dtype=torch.float64), 1e-5, 0.05)


def test_rule_uses_relative_tolerance_of_reference():
    ref = torch.tensor([100.0, 100.0], dtype=torch.float64)
    out = torch.tensor([104.9, 105.1], dtype=torch.float64)  # rtol 0.05 of |ref| = 5.0
    r = tolerance_report(out, ref, atol=1e-5, rtol=0.05)
    assert r.match_ratio == 0.5
