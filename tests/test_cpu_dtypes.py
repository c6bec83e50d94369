"""What every public op does with CPU tensors (README, "Use"): the reference runs on bfloat16,
float32 or float64 inputs, every tensor of a call in one dtype (float32 arithmetic, float64 for
float64 inputs); float16, mixed dtypes and eps <= 0 are refused with errors naming the argument,
by the top-level ops and by altup_cupy.torch alike."""

from __future__ import annotations

import pytest
import torch

import altup_cupy
from altup_cupy import torch as altup
from altup_cupy.reference import collapse_reference, predict_correct_backward_reference
from altup_cupy.reference import gemma3n as ref
from gemma3n_support import random_altup_inputs

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
ACCEPTED = (BF16, F32, F64)
N, ACTIVE = 3, 1


def _inputs(seed, dtype):
    return random_altup_inputs(seed, N, dtype=dtype)


def _public_calls(x):
    """name -> a call of one public op on the inputs x (all of one dtype)."""
    return {
        "collapse": lambda: altup_cupy.collapse(x.hidden_states, x.projections),
        "predict_correct_backward": lambda: altup_cupy.predict_correct_backward(
            x.grad_streams, x.hidden_states, x.activated, x.prediction_coefs, x.correction_coefs,
            x.router_weight, x.norm_weight, ACTIVE),
        "torch.predict": lambda: altup.predict(x.hidden_states, x.prediction_coefs, x.router_weight,
                                               x.norm_weight, ACTIVE),
        "torch.correct": lambda: altup.correct(x.hidden_states, x.activated, x.correction_coefs,
                                               x.router_weight, x.norm_weight, ACTIVE),
        "torch.expand": lambda: altup.expand(x.activated, list(x.projections)),
        "torch.collapse": lambda: altup.collapse(x.hidden_states, list(x.projections)),
    }


OPS = tuple(_public_calls(_inputs(0, F32)))
# The first tensor of each call: it sets the call's dtype, so a float16 one is named.
FIRST = {"collapse": "hidden_states", "predict_correct_backward": "grad_corrected", "torch.predict": "hidden_states",
         "torch.correct": "predictions", "torch.expand": "embeddings", "torch.collapse": "hidden_states"}


def _outputs(result):
    return list(result) if isinstance(result, tuple) else [result]


@pytest.mark.parametrize("dtype", ACCEPTED, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_every_public_op_runs_the_reference_on_cpu(seeds, op, dtype):
    out = _outputs(_public_calls(_inputs(seeds(), dtype))[op]())
    assert out[0].dtype == dtype and out[0].device.type == "cpu"
    assert all(torch.isfinite(o).all() for o in out)


@pytest.mark.parametrize("dtype", ACCEPTED, ids=str)
def test_top_level_ops_compute_in_float32_or_float64(seeds, dtype):
    x = _inputs(seeds(), dtype)
    compute = F64 if dtype == F64 else F32
    torch.testing.assert_close(altup_cupy.collapse(x.hidden_states, x.projections),
                               collapse_reference(x.hidden_states, x.projections, 1e-5, compute).to(dtype),
                               rtol=0, atol=0)
    args = (x.grad_streams, x.hidden_states, x.activated, x.prediction_coefs, x.correction_coefs,
            x.router_weight, x.norm_weight)
    grads = altup_cupy.predict_correct_backward(*args, ACTIVE, 1e-6)
    expected = predict_correct_backward_reference(*args, ACTIVE, 1e-6, compute)
    for got, want in zip(grads[:2], expected[:2]):
        torch.testing.assert_close(got, want.to(dtype), rtol=0, atol=0)
    for got, want in zip(grads[2:], expected[2:]):  # weight gradients: fp32 as on CUDA, float64 for float64
        assert got.dtype == compute
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_torch_predict_matches_the_reference_in_float32(seeds):
    x = _inputs(seeds(), BF16)
    got = altup.predict(x.hidden_states, x.prediction_coefs, x.router_weight, x.norm_weight, ACTIVE)
    want = ref.predict_forward(x.hidden_states, x.prediction_coefs, x.router_weight, x.norm_weight, ACTIVE, 1e-6,
                               F32, 1 / x.hidden_states.shape[-1])
    torch.testing.assert_close(got, want.to(BF16), rtol=0, atol=0)


@pytest.mark.parametrize("op", OPS)
def test_float16_is_refused_naming_the_first_tensor(seeds, op):
    call = _public_calls(_inputs(seeds(), F16))[op]
    with pytest.raises(TypeError, match=rf"{FIRST[op]} must have dtype .*got float16"):
        call()


@pytest.mark.parametrize("op", OPS)
def test_mixed_dtypes_are_refused_naming_the_tensor(seeds, op):
    x = _inputs(seeds(), F32)
    x.router_weight, x.projections = x.router_weight.to(BF16), x.projections.to(BF16)
    odd = "router_weight" if op in ("predict_correct_backward", "torch.predict", "torch.correct") else (
        "unembed_projs" if op in ("collapse", "torch.collapse") else "projections")
    with pytest.raises(TypeError, match=rf"{odd}(\[0\])? must have dtype float32.*got bfloat16"):
        _public_calls(x)[op]()


BAD_SCALARS = [0.0, -1e-6, float("nan"), float("inf")]


@pytest.mark.parametrize("value", BAD_SCALARS)
def test_torch_ops_refuse_eps_and_floor_as_the_top_level_ops_do(seeds, value):
    x = _inputs(seeds(), F32)
    calls = {
        "eps": [lambda: altup.predict(x.hidden_states, x.prediction_coefs, x.router_weight, x.norm_weight, 0, value),
                lambda: altup.correct(x.hidden_states, x.activated, x.correction_coefs, x.router_weight,
                                      x.norm_weight, 0, value),
                lambda: altup.collapse(x.hidden_states, list(x.projections), value),
                lambda: altup_cupy.collapse(x.hidden_states, x.projections, value)],
        "router_scale": [lambda: altup.predict(x.hidden_states, x.prediction_coefs, x.router_weight, x.norm_weight,
                                               0, 1e-6, value)],
        "floor": [lambda: altup.expand(x.activated, list(x.projections), value),
                  lambda: torch.ops.altup_cupy.expand(x.activated, list(x.projections), value)],
    }
    for name, named_calls in calls.items():
        for call in named_calls:
            with pytest.raises(ValueError, match=rf"{name} must be finite and > 0"):
                call()


def test_eps_zero_no_longer_gives_non_finite_rows():
    """A zero row with eps = 0 divides by zero in the router's norm: refused up front."""
    h = torch.zeros(N, 1, 2, 16)
    P, R, w = torch.zeros(N * N, N), torch.ones(N, 16), torch.ones(16)
    with pytest.raises(ValueError, match="eps must be finite and > 0, got 0.0"):
        altup.predict(h, P, R, w, 0, eps=0.0)
    assert torch.isfinite(altup.predict(h, P, R, w, 0, eps=1e-6)).all()


def test_eps_must_be_a_number():
    x = _inputs(0, F32)
    with pytest.raises(TypeError, match="eps must be a real number, got str"):
        altup.predict(x.hidden_states, x.prediction_coefs, x.router_weight, x.norm_weight, 0, "1e-6")
