"""The Gemma 3n launch plans (`gemma3n_altup_versions`) on the CPU: every launch a plan issues gets one
value per argument its kernel declares, of the declared kind, in the documented order, and every
GEMM the documented operands. The kernels and cuBLASLt are replaced by recorders (CPU tensors have
real addresses), so a slip in a plan's argument list fails here, before a GPU would see it."""

from __future__ import annotations

import contextlib

import pytest
import torch

from altup_cupy import _cublas, _device
from altup_cupy.ops import gemma3n_altup_versions as kernels

BF16 = torch.bfloat16
KINDS = {"ptr": int, "i32": int, "i64": int, "f32": float}
EPS, SCALE, FLOOR = 1e-6, 1 / 64, 1e-5


class RecordedLaunch:
    """Stands in for a PackedLaunch of KERNELS[step][version - 1]; checks each call's values."""

    def __init__(self, log, step, version, params, device, threads, shared_mem=0):
        self.log, self.step, self.params = log, step, params
        self.arg_types = kernels.KERNELS[step][version - 1].arg_types

    def __call__(self, stream, grid, *values):
        assert len(values) == len(self.arg_types), (self.step, len(values), len(self.arg_types))
        for kind, value in zip(self.arg_types, values):
            assert type(value) is KINDS[kind], (self.step, kind, value)
        self.log.append((self.step, self.params, grid, values))


class RecordedGemm:
    """Stands in for a `_cublas.Gemm`: records each call's addresses."""

    workspace_bytes = 0

    def __init__(self, log, **shape):
        self.log, self.shape = log, shape

    def __call__(self, x, y, d, workspace, stream):
        self.log.append(("gemm", self.shape, (x, y, d)))


@pytest.fixture
def log(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "_row_launch", lambda *args, **kw: RecordedLaunch(calls, *args, **kw))
    monkeypatch.setattr(_cublas, "Gemm", lambda **shape: RecordedGemm(calls, **shape))
    monkeypatch.setattr(kernels, "_stream", lambda device: 0)
    monkeypatch.setattr(_device, "on", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(_device, "sm_count", lambda index: 132)
    monkeypatch.setattr(_device, "shared_memory_per_sm", lambda index: 228 * 1024)
    builders = (kernels.row_forward_plan, kernels.routed_backward_plan, kernels.expand_plan,
                kernels.expand_backward_plan, kernels.collapse_backward_plan)
    for builder in builders:
        builder.cache_clear()
    yield calls
    for builder in builders:  # the plans hold recorders: none may serve a later call
        builder.cache_clear()


def rand(*shape):
    return torch.randn(*shape).to(BF16)


def address(t):
    return 0 if t is None else t.data_ptr()


STREAMS, TOKENS, HIDDEN = 4, 6, 64


@pytest.mark.parametrize("with_active", [False, True])
def test_forward_plans_pass_inputs_then_outputs(log, with_active):
    hs, act = rand(STREAMS, 2, 3, HIDDEN), rand(2, 3, HIDDEN)
    P, Q, R, w = rand(STREAMS * STREAMS, STREAMS), rand(STREAMS, STREAMS), rand(STREAMS, HIDDEN), rand(HIDDEN)
    pred = kernels.predict_forward(hs, P, R, w, 1, EPS, SCALE, with_active=with_active)
    corrected = kernels.correct_forward(hs, act, Q, R, w, 1, EPS, SCALE, with_active=with_active)
    (step_p, params_p, grid_p, values_p), (step_c, params_c, grid_c, values_c) = log
    assert (step_p, params_p, grid_p) == ("predict_forward", (STREAMS, 1), TOKENS)
    pred_out, pred_active = pred if with_active else (pred, None)
    assert values_p[:6] == tuple(map(address, (hs, P, R, w, pred_out, pred_active)))
    assert values_p[6:] == (TOKENS, HIDDEN, EPS, SCALE)
    assert (step_c, params_c, grid_c) == ("correct_forward", (STREAMS, 1), TOKENS)
    out, active = corrected if with_active else (corrected, None)
    assert values_c[:7] == tuple(map(address, (hs, act, Q, R, w, out, active)))


@pytest.mark.parametrize("with_grad_active", [False, True])
@pytest.mark.parametrize("step", ["predict_backward", "correct_backward"])
def test_routed_backward_plans_pass_partials_to_the_sum(log, step, with_grad_active):
    grad, hs, act = rand(STREAMS, 2, 3, HIDDEN), rand(STREAMS, 2, 3, HIDDEN), rand(2, 3, HIDDEN)
    P, Q, R, w = rand(STREAMS * STREAMS, STREAMS), rand(STREAMS, STREAMS), rand(STREAMS, HIDDEN), rand(HIDDEN)
    grad_active = rand(2, 3, HIDDEN) if with_grad_active else None
    if step == "predict_backward":
        grads = kernels.predict_backward(grad, hs, P, R, w, 2, EPS, SCALE, grad_active=grad_active)
        inputs, activation_grads, coefs = (grad, grad_active, hs, P, R, w), grads[:1], P
    else:
        grads = kernels.correct_backward(grad, hs, act, Q, R, w, 2, EPS, SCALE, grad_active=grad_active)
        inputs, activation_grads, coefs = (grad, grad_active, hs, act, Q, R, w), grads[:2], Q
    (main_step, params, blocks, main), (sum_step, _, _, summed) = log
    assert main_step == step and params == (STREAMS, 2, "true" if with_grad_active else "false")
    pointers = len(inputs) + len(activation_grads)
    assert main[:pointers] == tuple(map(address, (*inputs, *activation_grads)))
    partials, stride = main[pointers], main[pointers + 1]
    assert main[pointers + 2:] == (TOKENS, HIDDEN, EPS, SCALE)
    assert blocks == TOKENS and stride % 4 == 0 and stride >= STREAMS * HIDDEN + coefs.numel()
    assert sum_step == "router_grads"
    assert summed[:3] == (partials, blocks, stride)
    assert summed[3:] == (HIDDEN, coefs.numel(), address(R), address(w), SCALE, *map(address, grads[-3:]))
    assert grads[-3].shape == coefs.shape and grads[-2].shape == R.shape and grads[-1].shape == w.shape


def test_expansion_plans_write_each_projection_into_its_column_block(log):
    x0, weights = rand(2, 3, HIDDEN), [rand(HIDDEN, HIDDEN) for _ in range(STREAMS - 1)]
    streams, projected = kernels.expand_forward(x0, weights, FLOOR)
    gemms = [entry for entry in log if entry[0] == "gemm"]
    assert [g[2] for g in gemms] == [(address(x0), address(w), address(projected) + 4 * k * HIDDEN)
                                     for k, w in enumerate(weights)]
    (epilogue,) = [entry for entry in log if entry[0] == "expand_forward"]
    assert epilogue[3] == (address(x0), address(projected), address(streams), HIDDEN, (STREAMS - 1) * HIDDEN,
                           TOKENS, HIDDEN, FLOOR)
    log.clear()
    kernels.expand_epilogue(0, STREAMS, TOKENS, HIDDEN, address(x0), address(projected), address(streams), FLOOR)
    assert log == [epilogue]  # the launcher the benchmark times issues the plan's very launch
    log.clear()
    grad = rand(STREAMS, 2, 3, HIDDEN)
    grad_x0, grad_weights = kernels.expand_backward(grad, x0, weights, projected, FLOOR)
    assert grad_x0.dtype == BF16 and grad_weights.shape == (STREAMS - 1, HIDDEN, HIDDEN)
    assert [entry[0] for entry in log] == ["magnitude_match_backward"] + ["gemm"] * STREAMS
    match = log[0][3]
    assert match[:3] == (address(grad), address(x0), address(projected)) and match[5:] == (
        TOKENS * HIDDEN, 1.0, HIDDEN, (STREAMS - 1) * HIDDEN, HIDDEN, FLOOR)
    gp, grad_base = match[3], match[4]
    assert [g[2] for g in log[1:STREAMS]] == [(gp + 2 * k * HIDDEN, address(w), grad_base)
                                              for k, w in enumerate(weights)]
    assert log[STREAMS][2] == (gp, address(x0), address(grad_weights))


def test_collapse_backward_plan_recomputes_then_differentiates_each_projection(log):
    hs, grad_out = rand(STREAMS, 2, 3, HIDDEN), rand(2, 3, HIDDEN)
    weights = [rand(HIDDEN, HIDDEN) for _ in range(STREAMS - 1)]
    grad_hs, grad_weights = kernels.collapse_backward(grad_out, hs, weights, FLOOR)
    plane = TOKENS * HIDDEN
    assert [entry[0] for entry in log] == (["gemm"] * (STREAMS - 1) + ["magnitude_match_backward"]
                                           + ["gemm"] * STREAMS)
    y = log[0][2][2]
    assert [g[2] for g in log[:STREAMS - 1]] == [(address(hs) + 2 * (k + 1) * plane, address(u), y + 4 * k * plane)
                                                 for k, u in enumerate(weights)]
    match = log[STREAMS - 1][3]
    assert match[:3] == (address(grad_out), address(hs), y) and match[4] == address(grad_hs)
    assert match[5:] == (0, 1.0 / STREAMS, plane, HIDDEN, HIDDEN, FLOOR)
    gp = match[3]
    assert [g[2] for g in log[STREAMS:2 * STREAMS - 1]] == [
        (gp + 2 * k * plane, address(u), address(grad_hs) + 2 * (k + 1) * plane) for k, u in enumerate(weights)]
    assert log[-1][2] == (gp, address(hs) + 2 * plane, address(grad_weights))
