"""altup_cupy.torch on the CPU: gradcheck in float64, fake shapes, torch.compile, named errors."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from altup_cupy.ops import gemma3n_altup
from altup_cupy import torch as altup
from gemma3n_support import random_altup_inputs

CASES = [(n, a) for n in (2, 3, 4) for a in range(n)]


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


@pytest.mark.parametrize("streams,active", CASES)
def test_predict_and_correct_gradcheck(seeds, streams, active):
    x = random_altup_inputs(seeds(), streams, batch=1, seq=2, hidden=8)
    h, P, Q, R, w = _leaves(x.hidden_states, x.prediction_coefs, x.correction_coefs, x.router_weight, x.norm_weight)
    layer = torch.randn(8, 8, dtype=torch.float64) / 3

    def step(h, P, Q, R, w):
        """predict -> a layer on the active prediction -> correct: two autograd nodes."""
        pred = altup.predict(h, P, R, w, active, 1e-6)
        activated = torch.tanh(pred[active] @ layer)
        return altup.correct(pred, activated, Q, R, w, active, 1e-6)

    assert torch.autograd.gradcheck(step, (h, P, Q, R, w))


@pytest.mark.parametrize("streams,active", CASES)
def test_with_active_forms_gradcheck_and_match_the_views(seeds, streams, active):
    """predict_with_active / correct_with_active, used as the patched decoder layer uses them (the
    active copies read on their own, corrected streams 1..N-1 updated in place): gradcheck, and the
    same values and gradients as predict / correct with the rows read as views."""
    x = random_altup_inputs(seeds(), streams, batch=1, seq=2, hidden=8)
    h, P, Q, R, w = _leaves(x.hidden_states, x.prediction_coefs, x.correction_coefs, x.router_weight, x.norm_weight)
    layer = torch.randn(8, 8, dtype=torch.float64) / 3

    def step(h, P, Q, R, w, split=True):
        if split:
            pred, active_pred = altup.predict_with_active(h, P, R, w, active, 1e-6)
        else:
            pred = altup.predict(h, P, R, w, active, 1e-6)
            active_pred = pred[active]
        activated = torch.tanh(active_pred @ layer) + active_pred
        if split:
            corrected, first = altup.correct_with_active(pred, activated, Q, R, w, active, 1e-6)
        else:
            corrected = altup.correct(pred, activated, Q, R, w, active, 1e-6)
            first = corrected[active].clone()
        corrected[1:] += torch.sin(first @ layer)
        return corrected

    assert torch.autograd.gradcheck(step, (h, P, Q, R, w))
    grad = torch.randn(h.shape, dtype=torch.float64)
    split, views = step(h, P, Q, R, w), step(h, P, Q, R, w, split=False)
    torch.testing.assert_close(split, views, rtol=0, atol=0)
    for a, b in zip(torch.autograd.grad(split, (h, P, Q, R, w), grad),
                    torch.autograd.grad(views, (h, P, Q, R, w), grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_calls_that_record_no_gradient_go_straight_to_the_implementation(seeds, monkeypatch):
    """The operators' autograd kernel (`_operators.Operator.register_autograd`) sends a call that
    records no gradient on plain tensors straight to the implementation (no second dispatch), with
    the values of the recorded call and no autograd node; a call that records one, and a fake
    tensor's call, go through the dispatcher (to torch's autograd kernel, to the fake
    implementation)."""
    from altup_cupy.ops.collapse import collapse_op

    x = random_altup_inputs(seeds(), 4, batch=1, seq=2, hidden=8)
    h, P, R, w = _leaves(x.hidden_states, x.prediction_coefs, x.router_weight, x.norm_weight)
    projections = _leaves(*torch.randn(3, 8, 8, dtype=torch.float64).unbind())
    inputs = (h, P, R, w, *projections)
    cases = {"predict": (gemma3n_altup.predict, lambda *t: altup.predict(*t[:4], 1, 1e-6)),
             "collapse": (collapse_op, lambda *t: altup.collapse(t[0], t[4:]))}
    for name, (operator, call) in cases.items():
        straight = []
        impl = operator.impl
        monkeypatch.setattr(operator, "impl", lambda *args, **kwargs: straight.append(1) or impl(*args, **kwargs))
        recorded = call(*inputs)
        assert recorded.grad_fn is not None and not straight, name
        with torch.no_grad():
            unrecorded = call(*inputs)
        plain = call(*(t.detach() for t in inputs))
        assert len(straight) == 2, name
        for result in (unrecorded, plain):
            assert result.grad_fn is None and not result.requires_grad, name
            assert torch.equal(result, recorded.detach()), name
        detached = [t.detach() for t in inputs]
        with FakeTensorMode() as mode:
            fake = call(*(mode.from_tensor(t) for t in detached))
        assert len(straight) == 2 and type(fake).__name__ == "FakeTensor" and fake.shape == recorded.shape, name


@pytest.mark.parametrize("step", ("predict", "predict_with_active", "correct", "correct_with_active", "expand",
                                  "collapse"))
def test_a_second_derivative_is_refused_not_wrong(seeds, step):
    """The backwards are kernels without a derivative: create_graph=True through one raises (autograd
    would otherwise treat the kernel's outputs as constants and drop terms)."""
    x = random_altup_inputs(seeds(), 3, batch=1, seq=2, hidden=8)
    h, act, P, Q, R, w, W = _leaves(x.hidden_states, x.activated, x.prediction_coefs, x.correction_coefs,
                                    x.router_weight, x.norm_weight, x.projections)
    calls = {"predict": lambda: altup.predict(h, P, R, w),
             "predict_with_active": lambda: altup.predict_with_active(h, P, R, w)[1],
             "correct": lambda: altup.correct(h, act, Q, R, w),
             "correct_with_active": lambda: altup.correct_with_active(h, act, Q, R, w)[1],
             "expand": lambda: altup.expand(act, list(W.unbind())),
             "collapse": lambda: altup.collapse(h, list(W.unbind()))}
    out = calls[step]()
    leaves = [h, act, P, Q, R, w, W]
    with pytest.raises(RuntimeError, match="second derivatives"):
        torch.autograd.grad(out.square().sum(), leaves, create_graph=True, allow_unused=True)
    first = torch.autograd.grad(calls[step]().square().sum(), leaves, allow_unused=True)  # first order: fine
    assert any(g is not None for g in first)


@pytest.mark.parametrize("streams", (2, 3, 4))
def test_expand_and_collapse_gradcheck(seeds, streams):
    x = random_altup_inputs(seeds(), streams, batch=1, seq=2, hidden=8)
    e, *W = _leaves(x.activated, *x.projections)
    s, *U = _leaves(x.hidden_states, *x.projections)
    assert torch.autograd.gradcheck(lambda e, *W: altup.expand(e, W), (e, *W))
    assert torch.autograd.gradcheck(lambda s, *U: altup.collapse(s, U), (s, *U))


@pytest.mark.parametrize("streams", (2, 4))
def test_ops_pass_opcheck(seeds, streams):
    """torch.library.opcheck: schema, fake implementation and autograd registration agree."""
    x = random_altup_inputs(seeds(), streams, batch=1, seq=2, hidden=8, dtype=torch.float32)
    R, w = x.router_weight, x.norm_weight
    hs, P, Q, act = _leaves(x.hidden_states, x.prediction_coefs, x.correction_coefs, x.activated)
    ops = torch.ops.altup_cupy
    projections = list(x.projections)
    checks = [
        (ops.predict, (hs, P, R, w, streams - 1, 1e-6, 0.125)),
        (ops.correct, (hs, act, Q, R, w, 0, 1e-6, 0.125)),
        (ops.expand, (act, projections, 1e-5)),
        (ops.collapse, (hs, projections, 1e-5)),
        (ops.predict_with_active, (hs, P, R, w, streams - 1, 1e-6, 0.125)),
        (ops.correct_with_active, (hs, act, Q, R, w, 0, 1e-6, 0.125)),
        (ops.predict_backward, (x.grad_streams, x.hidden_states, x.prediction_coefs, R, w, 0, 1e-6, 0.125)),
        (ops.predict_backward, (x.grad_streams, x.hidden_states, x.prediction_coefs, R, w, 0, 1e-6, 0.125,
                                x.grad_row)),
        (ops.correct_backward, (x.grad_streams, x.hidden_states, x.activated, x.correction_coefs, R, w, 1, 1e-6,
                                0.125)),
        (ops.correct_backward, (x.grad_streams, x.hidden_states, x.activated, x.correction_coefs, R, w, 1, 1e-6,
                                0.125, x.grad_row)),
        (ops.collapse_backward, (x.grad_row, x.hidden_states, projections, 1e-5)),
    ]
    for op, args in checks:
        torch.library.opcheck(op, args)


def test_fake_shapes_and_dtypes():
    with FakeTensorMode():
        h = torch.empty(4, 2, 8, 16, dtype=torch.bfloat16)
        act = torch.empty(2, 8, 16, dtype=torch.bfloat16)
        P, Q = torch.empty(16, 4, dtype=torch.bfloat16), torch.empty(4, 4, dtype=torch.bfloat16)
        R, w = torch.empty(4, 16, dtype=torch.bfloat16), torch.empty(16, dtype=torch.bfloat16)
        W = [torch.empty(16, 16, dtype=torch.bfloat16) for _ in range(3)]
        ops = torch.ops.altup_cupy
        assert ops.predict(h, P, R, w, 0, 1e-6, 1 / 16).shape == h.shape
        assert ops.correct(h, act, Q, R, w, 0, 1e-6, 1 / 16).shape == h.shape
        streams, projected = ops.expand(act, W, 1e-5)
        assert streams.shape == (4, 2, 8, 16) and projected.shape == (2, 8, 3, 16)
        assert ops.collapse(h, W, 1e-5).shape == act.shape
        grads = ops.predict_backward(h, h, P, R, w, 0, 1e-6, 1 / 16)
        assert [g.shape for g in grads] == [h.shape, P.shape, R.shape, w.shape]
        assert grads[0].dtype == torch.bfloat16 and grads[1].dtype == torch.float32
        grads = ops.correct_backward(h, h, act, Q, R, w, 0, 1e-6, 1 / 16)
        assert [g.shape for g in grads] == [h.shape, act.shape, Q.shape, R.shape, w.shape]
        grad_s, grad_u = ops.collapse_backward(act, h, W, 1e-5)
        assert grad_s.shape == h.shape and [g.shape for g in grad_u] == [(16, 16)] * 3


def test_compiles_fullgraph_on_cpu(seeds):
    x = random_altup_inputs(seeds(), 4, dtype=torch.float32)
    layer = torch.randn(16, 16) / 4

    def model(embeddings, W, U, P, Q, R, w):
        streams = altup.expand(embeddings, W)
        pred = altup.predict(streams, P, R, w, 0, 1e-6)
        corrected = altup.correct(pred, torch.tanh(pred[0] @ layer), Q, R, w, 0, 1e-6)
        return altup.collapse(corrected, U)

    inputs = _leaves(x.activated, x.projections, x.projections, x.prediction_coefs, x.correction_coefs,
                     x.router_weight, x.norm_weight)
    W, U = list(inputs[1].unbind()), list(inputs[2].unbind())
    eager = model(inputs[0], W, U, *inputs[3:])
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(inputs[0], W, U, *inputs[3:])
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    (g_eager,) = torch.autograd.grad(eager.sum(), inputs[3])
    (g_compiled,) = torch.autograd.grad(compiled.sum(), inputs[3])
    torch.testing.assert_close(g_compiled, g_eager, rtol=1e-6, atol=1e-6)


def test_compiles_fullgraph_with_dynamic_shapes_and_float_arguments(seeds):
    """dynamic=True traces a float argument as a symbolic float: the checks of eps and of the
    default floor must trace too."""
    x = random_altup_inputs(seeds(), 3, dtype=torch.float32)
    P, R, w, U = x.prediction_coefs, x.router_weight, x.norm_weight, list(x.projections)

    def model(hidden_states, eps):
        return altup.collapse(altup.predict(hidden_states, P, R, w, 1, eps), U)

    eager = model(x.hidden_states, 1e-6)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")(x.hidden_states, 1e-6)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_active_idx_changing_between_compiled_calls(seeds):
    """A compiled function called with another active_idx recompiles with the index symbolic (or
    traces it symbolic at once under dynamic=True): the checks compare it, the operators take it."""
    x = random_altup_inputs(seeds(), 4, dtype=torch.float32)
    P, Q, R, w = x.prediction_coefs, x.correction_coefs, x.router_weight, x.norm_weight

    def step(hidden_states, activated, active_idx):
        pred = altup.predict(hidden_states, P, R, w, active_idx, 1e-6)
        return altup.correct(pred, activated, Q, R, w, active_idx, 1e-6)

    for dynamic in (None, True):
        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True, dynamic=dynamic, backend="aot_eager")
        try:
            for active_idx in (1, 2, 3):
                torch.testing.assert_close(compiled(x.hidden_states, x.activated, active_idx),
                                           step(x.hidden_states, x.activated, active_idx), rtol=0, atol=0)
        finally:
            torch._dynamo.reset()


def test_stacked_collapse_weights_get_their_gradient(seeds):
    """altup_cupy.collapse takes the N-1 matrices stacked in one [N-1, H, H] tensor too: the backward
    gives that tensor its gradient, the list form's stacked."""
    x = random_altup_inputs(seeds(), 3)
    import altup_cupy

    hs, stacked = _leaves(x.hidden_states, x.projections)
    matrices = _leaves(*x.projections)
    g = torch.randn(x.activated.shape, dtype=x.activated.dtype)
    grads = torch.autograd.grad(altup_cupy.collapse(hs, stacked, 1e-5), (hs, stacked), g)
    hs_list = _leaves(x.hidden_states)[0]
    list_grads = torch.autograd.grad(altup_cupy.collapse(hs_list, matrices, 1e-5), (hs_list, *matrices), g)
    torch.testing.assert_close(grads[0], list_grads[0], rtol=0, atol=0)
    torch.testing.assert_close(grads[1], torch.stack(list_grads[1:]), rtol=0, atol=0)
    assert torch.autograd.gradcheck(lambda s, u: altup_cupy.collapse(s, u, 1e-5), (hs, stacked))


def test_arguments_the_schemas_would_refuse_get_named_errors(seeds):
    x = random_altup_inputs(seeds(), 3, dtype=torch.float32)
    tensors = (x.hidden_states, x.prediction_coefs, x.router_weight, x.norm_weight)
    for active_idx in (True, 1.0, None, "0"):
        with pytest.raises(TypeError, match="active_idx must be an int"):
            altup.predict(*tensors, active_idx)
        with pytest.raises(TypeError, match="active_idx must be an int"):
            altup.correct_with_active(x.hidden_states, x.activated, x.correction_coefs, x.router_weight,
                                      x.norm_weight, active_idx)
    with pytest.raises(TypeError, match="hidden_states must be a torch.Tensor, got ndarray"):
        altup.predict(x.hidden_states.numpy(), *tensors[1:])
    with pytest.raises(TypeError, match=r"projections\[1\] must be a torch.Tensor"):
        altup.expand(x.activated, [x.projections[0], x.projections[1].numpy()])
    with pytest.raises(TypeError, match=r"unembed_projs\[0\] must be a torch.Tensor"):
        altup.collapse(x.hidden_states, [None, x.projections[1]])
    with pytest.raises(ValueError, match=r"projections must hold N-1 matrices for N in \(2, 3, 4\) streams, got 0"):
        altup.expand(x.activated, [])


def test_named_errors(seeds):
    x = random_altup_inputs(seeds(), 3, dtype=torch.float32)
    with pytest.raises(ValueError, match="prediction_coefs must have shape"):
        altup.predict(x.hidden_states, x.correction_coefs, x.router_weight, x.norm_weight, 0)
    with pytest.raises(ValueError, match="active_idx must satisfy"):
        altup.correct(x.hidden_states, x.activated, x.correction_coefs, x.router_weight, x.norm_weight, 3)
    with pytest.raises(ValueError, match="must hold N-1 = 2"):
        altup.collapse(x.hidden_states, list(x.projections[:1]))
    with pytest.raises(ValueError, match="activated must have shape"):
        altup.correct(x.hidden_states, x.activated[:, :1], x.correction_coefs, x.router_weight, x.norm_weight, 0)
    ops = torch.ops.altup_cupy
    with pytest.raises(ValueError, match=r"grad_active must be a 3-D tensor \[B, S, H\], got a 4-D tensor"):
        ops.predict_backward(x.grad_streams, x.hidden_states, x.prediction_coefs, x.router_weight, x.norm_weight,
                             0, 1e-6, 0.125, x.grad_streams)
    with pytest.raises(TypeError, match="grad_active must have dtype"):
        ops.correct_backward(x.grad_streams, x.hidden_states, x.activated, x.correction_coefs, x.router_weight,
                             x.norm_weight, 0, 1e-6, 0.125, x.grad_row.double())


def test_cpu_calls_are_held_to_the_kernels_shapes_and_one_device(seeds):
    """What runs on the CPU runs on CUDA: N outside 2..4 and H not a positive multiple of 8 are
    refused there too, and so is a tensor on another device (never an answer from uninitialised
    memory)."""
    x = random_altup_inputs(seeds(), 4, dtype=torch.float32)
    h, act, P, Q, R, w = (x.hidden_states, x.activated, x.prediction_coefs, x.correction_coefs, x.router_weight,
                          x.norm_weight)
    five = torch.cat([h, h[:1]])
    with pytest.raises(ValueError, match=r"hidden_states must hold N in \(2, 3, 4\) streams"):
        altup.predict(five, torch.zeros(25, 5), torch.zeros(5, 16), w)
    with pytest.raises(ValueError, match=r"hidden size H \(predictions dim 3\) must be positive and divisible by 8, got 12"):
        altup.correct(h[..., :12], act[..., :12], Q, R[:, :12], w[:12])
    with pytest.raises(ValueError, match="must be positive and divisible by 8, got 0"):
        altup.predict(h[..., :0], P, R[:, :0], w[:0])
    with pytest.raises(ValueError, match=r"projections must hold N-1 matrices for N in \(2, 3, 4\) streams, got 4"):
        altup.expand(act, [x.projections[0]] * 4)
    meta = {name: t.to("meta") for name, t in (("P", P), ("act", act), ("Q", Q), ("W", x.projections[1]))}
    with pytest.raises(ValueError, match="prediction_coefs is on meta but hidden_states is on cpu"):
        altup.predict(h, meta["P"], R, w)
    with pytest.raises(ValueError, match="activated is on meta but predictions is on cpu"):
        altup.correct(h, meta["act"], Q, R, w)
    with pytest.raises(ValueError, match="correction_coefs is on meta but predictions is on cpu"):
        altup.correct(h, act, meta["Q"], R, w)
    with pytest.raises(ValueError, match=r"projections\[1\] is on meta but embeddings is on cpu"):
        altup.expand(act, [x.projections[0], meta["W"], x.projections[2]])
    ops = torch.ops.altup_cupy
    with pytest.raises(ValueError, match="grad_predictions is on meta but hidden_states is on cpu"):
        ops.predict_backward(x.grad_streams.to("meta"), h, P, R, w, 0, 1e-6, 1 / 16)
    with pytest.raises(ValueError, match="grad_output is on meta but hidden_states is on cpu"):
        ops.collapse_backward(x.grad_row.to("meta"), h, list(x.projections), 1e-5)


def test_cuda_serves_names_the_limits():
    assert gemma3n_altup.cuda_serves(4, 2048) is None and gemma3n_altup.cuda_serves(4, 2560) is None
    assert "N = 5" in gemma3n_altup.cuda_serves(5, 2048)
    assert "H = 2052" in gemma3n_altup.cuda_serves(4, 2052)
    assert "H = 4096" in gemma3n_altup.cuda_serves(4, 4096)


def test_inputs_not_mutated(seeds):
    x = random_altup_inputs(seeds(), 4, dtype=torch.float32)
    before = [t.clone() for t in (x.hidden_states, x.activated, x.router_weight)]
    pred = altup.predict(x.hidden_states, x.prediction_coefs, x.router_weight, x.norm_weight, 2)
    altup.correct(pred, x.activated, x.correction_coefs, x.router_weight, x.norm_weight, 2)
    for b, a in zip(before, (x.hidden_states, x.activated, x.router_weight)):
        assert torch.equal(a, b)


def test_cuda_input_checks_name_the_argument():
    """What the CUDA implementations refuse, checked on CPU tensors (the checks read only metadata)."""
    good = torch.zeros(4, 2, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="hidden_states must be bfloat16 on CUDA, got torch.float32"):
        gemma3n_altup._check_cuda([("hidden_states", good.float())], 4, 64)
    with pytest.raises(ValueError, match="router_weight must be C-contiguous"):
        gemma3n_altup._check_cuda([("hidden_states", good), ("router_weight", good[0, 0].T)], 4, 64)
    with pytest.raises(ValueError, match="norm_weight must start at a 16-byte aligned address"):
        gemma3n_altup._check_cuda([("hidden_states", good), ("norm_weight", good.flatten()[1:65])], 4, 64)
    with pytest.raises(ValueError, match="do not take N = 5 streams"):
        gemma3n_altup._check_cuda([("hidden_states", good)], 5, 64)
