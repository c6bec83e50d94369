"""The float64 references of Gemma 3n's AltUp steps against torch.autograd and transformers."""

from __future__ import annotations

import pytest
import torch

from altup_cupy.reference import gemma3n as ref
from gemma3n_support import random_altup_inputs, tiny_text_config, transformers_gemma3n

CASES = [(n, a) for n in (2, 3, 4) for a in range(n)]
EPS = 1e-6


def _close(actual, expected, what, tol=1e-10):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


# transformers' router (RMSNorm and tanh) runs in float32 even in a float64 module
TF_TOL = 1e-4


def _autograd(forward, inputs, grad_output):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = forward(*leaves)
    return torch.autograd.grad(out, leaves, grad_outputs=grad_output)


# None: 1 / H; the other: 1 / H rounded to bf16 at H = 2560, as transformers' bf16 buffer holds it
ROUTER_SCALES = (None, 1.0009765625 / 16)


@pytest.mark.parametrize("router_scale", ROUTER_SCALES)
@pytest.mark.parametrize("streams,active", CASES)
def test_predict_backward_matches_autograd(seeds, streams, active, router_scale):
    x = random_altup_inputs(seeds(), streams)
    args = (x.hidden_states, x.prediction_coefs, x.router_weight, x.norm_weight)
    kw = dict(active_idx=active, eps=EPS, router_scale=router_scale)
    expected = _autograd(lambda *t: ref.predict_forward(*t, **kw), args, x.grad_streams)
    got = ref.predict_backward(x.grad_streams, *args, **kw)
    for name, g, e in zip(got._fields, got, expected):
        _close(g, e, name)


@pytest.mark.parametrize("router_scale", ROUTER_SCALES)
@pytest.mark.parametrize("streams,active", CASES)
def test_correct_backward_matches_autograd(seeds, streams, active, router_scale):
    x = random_altup_inputs(seeds(), streams)
    args = (x.hidden_states, x.activated, x.correction_coefs, x.router_weight, x.norm_weight)
    kw = dict(active_idx=active, eps=EPS, router_scale=router_scale)
    expected = _autograd(lambda *t: ref.correct_forward(*t, **kw), args, x.grad_streams)
    got = ref.correct_backward(x.grad_streams, *args, **kw)
    for name, g, e in zip(got._fields, got, expected):
        _close(g, e, name)


@pytest.mark.parametrize("step", ("expand", "collapse"))
@pytest.mark.parametrize("streams", (2, 3, 4))
def test_expand_and_collapse_backward_match_autograd(seeds, streams, step):
    """expand: embeddings -> N streams (incoming gradient [N, B, S, H]); collapse: N streams -> one
    row (incoming gradient [B, S, H])."""
    x = random_altup_inputs(seeds(), streams)
    first, grad = (x.activated, x.grad_streams) if step == "expand" else (x.hidden_states, x.grad_row)
    forward, backward = getattr(ref, f"{step}_forward"), getattr(ref, f"{step}_backward")
    expected = _autograd(lambda a, p: forward(a, list(p)), (first, x.projections), grad)
    got = backward(grad, first, list(x.projections))
    for name, g, e in zip(got._fields, got, expected):
        _close(g, e, name)


def test_magnitude_floor_clamps_the_gradient(seeds):
    """A projection with a tiny mean square sits on the floor: its n_k is constant there."""
    x = random_altup_inputs(seeds(), 3)
    projected = torch.stack([x.hidden_states[1], x.hidden_states[2] * 1e-4])
    assert projected[1].square().mean(-1).max() < ref.MAGNITUDE_FLOOR
    expected = _autograd(ref.magnitude_match_forward, (x.activated, projected), x.grad_streams[1:])
    got = ref.magnitude_match_backward(x.grad_streams[1:], x.activated, projected)
    _close(got.grad_projected, expected[1], "grad_projected")
    _close(got.grad_base, expected[0], "grad_base")


def _tf_altup(streams, hidden, active, clip, inputs, training):
    modeling = transformers_gemma3n()
    config = tiny_text_config(streams=streams, hidden=hidden, active_idx=active, coef_clip=clip)
    module = modeling.Gemma3nTextAltUp(config).double().train(training)
    with torch.no_grad():
        module.prediction_coefs.weight.copy_(inputs.prediction_coefs)
        module.correction_coefs.weight.copy_(inputs.correction_coefs)
        module.modality_router.weight.copy_(inputs.router_weight)
        module.router_norm.weight.copy_(inputs.norm_weight)
    return module


@pytest.mark.parametrize("streams,active", CASES)
@pytest.mark.parametrize("clip", (120.0, 0.3))  # 120: the released value, never reached here
@pytest.mark.parametrize("training", (False, True))
def test_steps_match_transformers_altup(seeds, streams, active, clip, training):
    """predict, then correct on an `activated` computed from the active prediction (as the layer
    does), through transformers' Gemma3nTextAltUp in float64, coefficient clipping included."""
    x = random_altup_inputs(seeds(), streams, coef_scale=0.5)
    # One coefficient of each matrix past the clip and one inside it, whatever the draw.
    for coefs in (x.prediction_coefs, x.correction_coefs):
        coefs[0, 0], coefs[-1, -1] = 0.9, 0.1
    module = _tf_altup(streams, 16, active, clip, x, training)
    P0 = module.prediction_coefs.weight.detach().clone()
    h = x.hidden_states.clone().requires_grad_(True)
    layer = torch.randn(16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) / 4

    pred = module.predict(h)
    activated = torch.tanh(pred[active] @ layer)
    corrected = module.correct(pred, activated)
    params = [module.prediction_coefs.weight, module.correction_coefs.weight,
              module.modality_router.weight, module.router_norm.weight]
    grads = torch.autograd.grad(corrected, [h, pred, activated] + params, x.grad_streams, retain_graph=True)
    clipping = training  # eval mode never clips
    P = P0.clamp(-clip, clip) if clipping else P0
    Q = x.correction_coefs.clamp(-clip, clip) if clipping else x.correction_coefs

    _close(ref.predict_forward(x.hidden_states, P, x.router_weight, x.norm_weight, active), pred, "pred", TF_TOL)
    corrected_ref = ref.correct_forward(pred, activated, Q, x.router_weight, x.norm_weight, active)
    _close(corrected_ref, corrected, "corrected", TF_TOL)

    c = ref.correct_backward(x.grad_streams, pred, activated, Q, x.router_weight, x.norm_weight, active)
    # the layer's backward, between the two nodes
    grad_pred = c.grad_predictions.clone()
    grad_pred[active] += torch.autograd.grad(activated, pred, c.grad_activated.detach(), retain_graph=True)[0][active]
    p = ref.predict_backward(grad_pred, x.hidden_states, P, x.router_weight, x.norm_weight, active)
    q_mask = (x.correction_coefs.abs() <= clip) if clipping else 1.0  # clamp's gradient
    _close(p.grad_hidden_states, grads[0], "grad_hidden_states", TF_TOL)
    _close(p.grad_prediction_coefs, grads[3], "grad_prediction_coefs", TF_TOL)
    _close(c.grad_correction_coefs * q_mask, grads[4], "grad_correction_coefs", TF_TOL)
    _close(p.grad_router_weight + c.grad_router_weight, grads[5], "grad_router_weight", TF_TOL)
    _close(p.grad_norm_weight + c.grad_norm_weight, grads[6], "grad_norm_weight", TF_TOL)
    if clipping and clip < 1:
        assert (P0.abs() > clip).any() and (x.correction_coefs.abs() > clip).any(), "clipping not exercised"
        assert (P0.abs() < clip).any() and (x.correction_coefs.abs() < clip).any(), "only clipped entries"


@pytest.mark.parametrize("streams", (2, 4))
def test_expand_and_collapse_match_transformers_model(seeds, streams):
    """The streams entering layer 0 and the output before the final norm, read from a tiny
    Gemma3nTextModel in float64 through hooks."""
    modeling = transformers_gemma3n()
    torch.manual_seed(seeds())
    model = modeling.Gemma3nTextModel(tiny_text_config(streams=streams)).double().eval()
    seen = {}  # the hooks return None: they only look
    model.layers[0].register_forward_pre_hook(lambda m, args: seen.update(expanded=args[0]))
    model.layers[-1].register_forward_hook(lambda m, args, out: seen.update(last=out))
    model.norm.register_forward_pre_hook(lambda m, args: seen.update(collapsed=args[0]))
    embeddings = torch.randn(2, 5, 16, dtype=torch.float64)
    model(inputs_embeds=embeddings)
    expand_W = [p.weight for p in model.altup_projections]
    collapse_W = [p.weight for p in model.altup_unembed_projections]
    with torch.no_grad():
        _close(ref.expand_forward(embeddings, expand_W), seen["expanded"], "expanded")
        _close(ref.collapse_forward(seen["last"], collapse_W), seen["collapsed"], "collapsed")


@pytest.mark.parametrize("router_scale", ROUTER_SCALES)
@pytest.mark.parametrize("streams,active", CASES)
def test_kernel_arithmetic_equals_the_step_by_step_backwards(seeds, streams, active, router_scale):
    """The one-reduction form the kernels compute is the same function."""
    x = random_altup_inputs(seeds(), streams)
    kw = dict(active_idx=active, eps=EPS, router_scale=router_scale)
    predict_args = (x.grad_streams, x.hidden_states, x.prediction_coefs, x.router_weight, x.norm_weight)
    for name, g, e in zip(ref.PredictGrads._fields, ref.predict_backward_one_reduction(*predict_args, **kw),
                          ref.predict_backward(*predict_args, **kw)):
        _close(g, e, f"predict {name}")
    correct_args = (x.grad_streams, x.hidden_states, x.activated, x.correction_coefs, x.router_weight,
                    x.norm_weight)
    for name, g, e in zip(ref.CorrectGrads._fields, ref.correct_backward_one_reduction(*correct_args, **kw),
                          ref.correct_backward(*correct_args, **kw)):
        _close(g, e, f"correct {name}")
