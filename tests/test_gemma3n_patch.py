"""altup_cupy.gemma3n.patch on a tiny real Gemma3nTextModel on the CPU (through the operators'
float32 CPU implementations): the same outputs and parameter gradients as transformers' own code."""

from __future__ import annotations

import copy
import dataclasses
import io
import warnings

import pytest
import torch

from gemma3n_support import count_altup_calls, tiny_text_config, transformers_gemma3n

modeling = transformers_gemma3n()
import transformers  # noqa: E402

import altup_cupy.gemma3n as gemma3n  # noqa: E402  (needs transformers)
from altup_cupy import gemma3n_forward  # noqa: E402

FP32_TOL = dict(rtol=2e-4, atol=2e-5)  # two fp32 evaluation orders of the same math
# Gradients after a few layers of attention carry fp32 cancellation in single elements: compared
# normwise, relative to the largest element of the tensor (what fp32 rounding errors scale with).
GRAD_NORMWISE_TOL = 1e-4


def _assert_close_normwise(actual, expected, what):
    scale = expected.abs().max().item()
    error = (actual - expected).abs().max().item()
    assert error <= GRAD_NORMWISE_TOL * scale + 1e-7, f"{what}: max error {error:.3g} vs max |grad| {scale:.3g}"


@pytest.fixture(autouse=True)
def _restore():
    yield
    gemma3n.unpatch()


def _model(seed, streams=4, active=0, clip=120.0, layers=2):
    torch.manual_seed(seed)
    model = modeling.Gemma3nTextModel(tiny_text_config(streams=streams, active_idx=active, coef_clip=clip,
                                                       layers=layers))
    with torch.no_grad():  # coefficients of a trained model's size (transformers initialises them to 0)
        for layer in model.layers:
            layer.altup.prediction_coefs.weight.normal_(0.0, 0.5)
            layer.altup.correction_coefs.weight.normal_(0.0, 0.5)
            layer.altup.correct_output_scale.normal_(1.0, 0.2)
            # One coefficient of each matrix past the clip of 0.3 and one inside it, whatever the draw.
            for coefs in (layer.altup.prediction_coefs.weight, layer.altup.correction_coefs.weight):
                coefs[0, 0], coefs[-1, -1] = 0.9, 0.1
    return model


def _run(model, ids, grad_seed):
    out = model(input_ids=ids).last_hidden_state
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed))
    out.backward(grad)
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def op_calls(monkeypatch):
    """How often the patched code reached each altup_cupy.torch function."""
    return count_altup_calls(monkeypatch.setattr)


@pytest.mark.parametrize("streams,active", [(2, 1), (3, 0), (4, 0), (4, 3)])
@pytest.mark.parametrize("clip", (120.0, 0.3))
def test_patched_model_matches_transformers(seeds, op_calls, streams, active, clip):
    model = _model(seeds(), streams, active, clip).train()
    patched = copy.deepcopy(model)
    ids = torch.randint(3, 64, (2, 9))
    grad_seed = seeds()
    expected_out, expected_grads = _run(model, ids, grad_seed)
    gemma3n.patch(patched, serve_cpu=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn: none may happen here
        out, grads = _run(patched, ids, grad_seed)
    layers = len(model.layers)
    assert op_calls == {"predict": layers, "correct": layers, "expand": 1, "collapse": 1}
    torch.testing.assert_close(out, expected_out, **FP32_TOL)
    assert grads.keys() == expected_grads.keys()
    for name, g in grads.items():
        _assert_close_normwise(g, expected_grads[name], name)
    if clip < 1:  # training mode clamped the prediction weights in place, in both models
        for a, b in zip(model.layers, patched.layers):
            assert a.altup.prediction_coefs.weight.abs().max() <= clip
            torch.testing.assert_close(a.altup.prediction_coefs.weight, b.altup.prediction_coefs.weight)
        assert any((layer.altup.correction_coefs.weight.abs() > clip).any() for layer in model.layers)


def test_eval_mode_does_not_clip(seeds, op_calls):
    model = _model(seeds(), clip=0.3).eval()
    before = [layer.altup.prediction_coefs.weight.clone() for layer in model.layers]
    patched = copy.deepcopy(model)
    gemma3n.patch(patched, serve_cpu=True)
    ids = torch.randint(3, 64, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state,
                                   **FP32_TOL)
    for layer, w in zip(patched.layers, before):
        assert torch.equal(layer.altup.prediction_coefs.weight, w)


def test_patch_and_unpatch_restore_the_classes():
    originals = {name: modeling.Gemma3nTextAltUp.__dict__[name] for name in ("predict", "correct")}
    forward = modeling.Gemma3nTextModel.__dict__["forward"]
    gemma3n.patch()
    gemma3n.patch()  # twice: still one layer of patching
    assert modeling.Gemma3nTextAltUp.predict is not originals["predict"]
    assert modeling.Gemma3nTextModel.forward is not forward
    gemma3n.unpatch()
    assert all(modeling.Gemma3nTextAltUp.__dict__[n] is f for n, f in originals.items())
    assert modeling.Gemma3nTextModel.__dict__["forward"] is forward


def test_class_patch_serves_new_models(seeds, op_calls):
    gemma3n.patch(serve_cpu=True)
    model = _model(seeds())
    model(input_ids=torch.randint(3, 64, (1, 4)))
    assert op_calls == {"predict": 2, "correct": 2, "expand": 1, "collapse": 1}


def test_instance_patch_and_unpatch(seeds, op_calls):
    model, other = _model(seeds()), _model(seeds())
    gemma3n.patch(model, serve_cpu=True)
    other(input_ids=torch.randint(3, 64, (1, 4)))
    assert sum(op_calls.values()) == 0  # only the patched instance changed
    model(input_ids=torch.randint(3, 64, (1, 4)))
    assert op_calls["predict"] == 2
    gemma3n.unpatch(model)
    assert all("predict" not in layer.altup.__dict__ for layer in model.layers)
    assert "forward" not in model.__dict__



def _bound_forwards(model) -> dict[tuple[str, str], bool]:
    """(module name, attribute) of every forward patch(model) bound, and whether it is bound to
    that very module."""
    return {(name, attribute): module.__dict__[attribute].__self__ is module
            for name, module in model.named_modules() for attribute in ("predict", "correct", "forward")
            if attribute in module.__dict__}


class _HoldsItsModule:
    """A forward hook that keeps a reference to its module: the module's pickled state refers back
    to the module."""

    def __init__(self, module):
        self.module = module

    def __call__(self, module, args, output):
        assert module is self.module


def _saved_and_loaded(model, how: str):
    if how == "deepcopy":
        return copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
def test_an_instance_patched_model_saves_and_loads_patched(seeds, op_calls, how):
    """torch.save(model) after patch(model) and torch.load (a bound forward would pickle as a
    lookup that fails on loading), or a deep copy: the copy's forwards are bound again, to its own
    modules, with the patch's settings, and give the original's outputs through the operators. A
    model unpatched before saving loads unpatched. A layer holds a hook that refers back to it, and
    the copy is saved and loaded once more."""
    model = _model(seeds()).eval()
    gemma3n.patch(model, serve_cpu=True, compiled_min_tokens=7)
    model.layers[0].register_forward_hook(_HoldsItsModule(model.layers[0]))
    model.layers[1]._saved_forward = model.layers[1].forward  # as a wrapper keeps the forward it wraps
    ids = torch.randint(3, 64, (1, 4))
    with torch.no_grad():
        expected = model(input_ids=ids).last_hidden_state
    bound = _bound_forwards(model)
    functions = {key: module.__dict__[key[1]].__func__.__code__ for key in bound
                 for name, module in model.named_modules() if name == key[0]}
    assert len(bound) == 2 * len(model.layers) + 1 + len(model.layers)  # predict, correct; forward of model and layers
    copied = _saved_and_loaded(_saved_and_loaded(model, how), how)
    assert _bound_forwards(copied) == bound and all(bound.values())
    assert {key: module.__dict__[key[1]].__func__.__code__ for key in bound
            for name, module in copied.named_modules() if name == key[0]} == functions  # the package's forwards
    assert callable(copied.layers[1]._saved_forward)
    assert next(iter(copied.layers[0]._forward_hooks.values())).module is copied.layers[0]
    assert all(module.__dict__[gemma3n._SERVE_CPU] is True and module.__dict__[gemma3n._COMPILED_MIN_TOKENS] == 7
               for name, module in copied.named_modules() if (name, "forward") in bound or (name, "predict") in bound)
    before = dict(op_calls)
    with torch.no_grad():
        got = copied(input_ids=ids).last_hidden_state
    assert op_calls["predict"] - before["predict"] == len(model.layers)
    assert op_calls["expand"] - before["expand"] == 1 and op_calls["collapse"] - before["collapse"] == 1
    assert torch.equal(got, expected)
    shallow = copy.copy(model.layers[0].altup)  # its state as it is, as for any module
    assert type(shallow.__dict__) is dict and shallow.__dict__["predict"] == model.layers[0].altup.predict
    gemma3n.unpatch(model)
    assert _bound_forwards(_saved_and_loaded(model, how)) == {}

def _assert_falls_back(model, op_calls, warning: str, serve_cpu: bool = True) -> None:
    """A patched copy of `model` warns (matching `warning`), calls none of altup_cupy's operators and
    gives exactly transformers' result."""
    patched = copy.deepcopy(model)
    gemma3n.patch(patched, serve_cpu=serve_cpu)
    ids = torch.randint(3, 64, (1, 6))
    with pytest.warns(UserWarning, match=warning):
        out = patched(input_ids=ids).last_hidden_state
    assert sum(op_calls.values()) == 0
    assert torch.equal(out, model(input_ids=ids).last_hidden_state)


def test_unserved_calls_warn_and_run_transformers_code(seeds, op_calls):
    """CPU tensors without serve_cpu: a warning, and exactly transformers' result."""
    _assert_falls_back(_model(seeds()).eval(), op_calls, "runs transformers' own code for tensors on cpu",
                       serve_cpu=False)


def test_serve_cpu_leaves_dtypes_the_reference_refuses_to_transformers(seeds, op_calls):
    """float16 on the CPU: the operators would refuse it, so the patch warns and runs
    transformers' code."""
    _assert_falls_back(_model(seeds()).eval().to(torch.float16), op_calls,
                       r"float16'\] \(the CPU reference takes one of bfloat16, float32")


@pytest.mark.parametrize("streams,hidden,reason", [(5, 16, "N = 5 streams"), (1, 16, "N = 1 streams"),
                                                   (4, 12, "hidden size H = 12")])
def test_serve_cpu_leaves_shapes_the_kernels_refuse_to_transformers(seeds, op_calls, streams, hidden, reason):
    """A shape the kernels refuse runs transformers' code on the CPU reference too (what is served
    on the CPU is served on CUDA), a model of one stream included (no projections at all)."""
    torch.manual_seed(seeds())
    model = modeling.Gemma3nTextModel(tiny_text_config(streams=streams, hidden=hidden, head_dim=6 if hidden == 12
                                                       else 8)).eval()
    _assert_falls_back(model, op_calls, f"runs transformers' own code for {reason}")


def test_serve_cpu_belongs_to_the_model_it_was_given_with(seeds, op_calls):
    served, other = _model(seeds()).eval(), _model(seeds()).eval()
    gemma3n.patch(served, serve_cpu=True)
    gemma3n.patch(other)  # the default, serve_cpu=False, for this model alone
    ids = torch.randint(3, 64, (1, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # served: no fallback warning
        served(input_ids=ids)
    assert op_calls["predict"] == 2
    with pytest.warns(UserWarning, match="runs transformers' own code for tensors on cpu"):
        other(input_ids=ids)
    assert op_calls["predict"] == 2
    gemma3n.unpatch(served)
    assert not any(gemma3n._SERVE_CPU in m.__dict__ for m in served.modules())


def test_unrecognised_forward_keeps_expansion_and_collapse(seeds, monkeypatch, op_calls):
    monkeypatch.setattr(gemma3n_forward, "KNOWN_FORWARDS", {})
    with pytest.warns(UserWarning, match="stay transformers' own"):
        gemma3n.patch(serve_cpu=True)
    assert (modeling.Gemma3nTextModel, "forward") not in gemma3n._originals
    _model(seeds())(input_ids=torch.randint(3, 64, (1, 4)))
    assert op_calls["expand"] == 0 and op_calls["predict"] == 2


def test_unrecognised_layer_forward_keeps_the_layers_on_our_predict_and_correct(seeds, monkeypatch):
    monkeypatch.setattr(gemma3n_forward, "KNOWN_LAYER_FORWARDS", {})
    calls = count_altup_calls(monkeypatch.setattr)
    with_active = []
    for name in ("predict_with_active", "correct_with_active"):
        monkeypatch.setattr(gemma3n.altup, name, lambda *a, _name=name: with_active.append(_name))
    model = _model(seeds()).train()
    patched = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="the layers keep transformers' forward"):
        gemma3n.patch(patched, serve_cpu=True)
    ids = torch.randint(3, 64, (2, 5))
    out, grads = _run(patched, ids, 7)
    expected_out, expected_grads = _run(model, ids, 7)
    assert with_active == [] and calls == {"predict": 2, "correct": 2, "expand": 1, "collapse": 1}
    torch.testing.assert_close(out, expected_out, **FP32_TOL)
    for name, g in grads.items():
        _assert_close_normwise(g, expected_grads[name], name)


@pytest.mark.parametrize("cls,known", [("Gemma3nTextModel", "KNOWN_FORWARDS"),
                                       ("Gemma3nTextDecoderLayer", "KNOWN_LAYER_FORWARDS")])
def test_installed_forward_is_one_the_package_reproduces(cls, known):
    """A transformers release whose Gemma3nTextModel or Gemma3nTextDecoderLayer forward changed fails
    here, not in a user's program: the hand-written forward must be checked against it and its
    fingerprint added."""
    installed = getattr(modeling, cls).__dict__["forward"]
    assert gemma3n_forward.fingerprint(installed) in getattr(gemma3n_forward, known), (
        f"transformers {transformers.__version__}: {cls}.forward has fingerprint "
        f"{gemma3n_forward.fingerprint(installed)}, not in altup_cupy.gemma3n_forward.{known}")


def test_patched_layers_pass_the_active_rows_as_tensors_of_their_own(seeds, monkeypatch):
    """The patched decoder layer calls the `_with_active` forms (their gradients join inside the
    backward kernels), and gives transformers' outputs and gradients (the test above, through them)."""
    forms = []
    for name in ("predict_with_active", "correct_with_active"):
        function = getattr(gemma3n.altup, name)
        monkeypatch.setattr(gemma3n.altup, name,
                            lambda *a, _name=name, _function=function: forms.append(_name) or _function(*a))
    model = _model(seeds(), layers=1)
    gemma3n.patch(model, serve_cpu=True)
    model(input_ids=torch.randint(3, 64, (1, 4)))
    assert forms == ["predict_with_active", "correct_with_active"]


def _documented():
    def forward(self, x):
        """documented"""
        return x + 1  # a comment
    return forward


def _commented():
    def forward(self, x):
        # another comment

        return x + 1
    return forward


def _changed():
    def forward(self, x):
        return x + 2
    return forward


def test_fingerprint_ignores_comments_and_docstrings_only():
    assert gemma3n_forward.fingerprint(_documented()) == gemma3n_forward.fingerprint(_commented())
    assert gemma3n_forward.fingerprint(_documented()) != gemma3n_forward.fingerprint(_changed())


@pytest.mark.parametrize("eps", (1e-6, 0.5))
def test_router_norm_epsilon_reaches_the_operators(seeds, eps):
    """The router norm's epsilon, wherever this transformers release keeps it (eps or
    variance_epsilon), is the one the operators get: at 0.5 a wrong one changes the output."""
    torch.manual_seed(seeds())
    model = modeling.Gemma3nTextModel(tiny_text_config(rms_norm_eps=eps)).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.altup.prediction_coefs.weight.normal_(0.0, 0.5)
            layer.altup.correction_coefs.weight.normal_(0.0, 0.5)
            layer.altup.modality_router.weight.normal_(0.0, 4.0)
    patched = copy.deepcopy(model)
    gemma3n.patch(patched, serve_cpu=True)
    ids = torch.randint(3, 64, (2, 7))
    assert gemma3n._router_eps(patched.layers[0].altup) == eps
    with torch.no_grad():
        # Normwise: the router weights of std 4 amplify the two fp32 evaluation orders' rounding in
        # single elements (base seed 33: 3.3e-5, outputs up to 0.76); an eps of 1e-6 where 0.5 is
        # right moves them by 0.82.
        _assert_close_normwise(patched(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state,
                               "last_hidden_state")


def test_the_output_names_the_cache_as_the_installed_release_does(seeds, monkeypatch):
    """The patched forward fills the output's own field for the KV cache (`cache` from 5.24,
    `past_key_values` before), not a deprecated alias that makes transformers log a warning."""
    output = modeling.BaseModelOutputWithPast
    keywords = []

    def recording(**kwargs):
        keywords.append(set(kwargs))
        return output(**kwargs)

    monkeypatch.setattr(modeling, "BaseModelOutputWithPast", recording)
    model = _model(seeds()).eval()
    gemma3n.patch(model, serve_cpu=True)
    with torch.no_grad():
        out = model(input_ids=torch.randint(3, 64, (1, 5)), use_cache=True)
    fields = {field.name for field in dataclasses.fields(output)}
    assert keywords and all(names <= fields for names in keywords), (keywords, fields)
    assert isinstance(out.past_key_values, transformers.Cache)


@pytest.mark.parametrize("class_patch", (False, True))
def test_gradient_checkpointing_recomputes_the_patched_layers(seeds, op_calls, class_patch):
    """With gradient checkpointing on, each patched layer runs again in the backward (its MLP twice
    a step, as in transformers' model) and the gradients are transformers' with checkpointing."""
    model = _model(seeds()).train()
    model.gradient_checkpointing_enable()
    patched = copy.deepcopy(model)
    mlp_runs = []
    patched.layers[0].mlp.register_forward_hook(lambda *_: mlp_runs.append(1))
    ids = torch.randint(3, 64, (2, 9))
    grad_seed = seeds()
    expected_out, expected_grads = _run(model, ids, grad_seed)
    gemma3n.patch(None if class_patch else patched, serve_cpu=True)
    out, grads = _run(patched, ids, grad_seed)
    assert op_calls["predict"] > 0, "the patched layers did not run on the operators"
    assert len(mlp_runs) == 2, f"layer 0 ran {len(mlp_runs)} times, not forward + recomputation"
    torch.testing.assert_close(out, expected_out, **FP32_TOL)
    for name, g in grads.items():
        _assert_close_normwise(g, expected_grads[name], name)


def _graph_breaks(model, ids):
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(input_ids=ids)
    return explanation.graph_break_count, [str(reason) for reason in explanation.break_reasons]


def test_torch_compile_adds_no_graph_break_and_matches_eager(seeds):
    """torch.compile of the patched model (the aot_eager backend, which runs the operators' fake
    and autograd registrations without a C++ compiler): no graph break the unpatched model does
    not have, none inside altup_cupy, and the same loss gradients as the patched model in eager."""
    model = _model(seeds()).train()
    patched = copy.deepcopy(model)
    gemma3n.patch(patched, serve_cpu=True, compiled_min_tokens=0)  # 18 tokens: compiled on the operators
    ids = torch.randint(3, 64, (2, 9))
    breaks, _ = _graph_breaks(model, ids)
    patched_breaks, reasons = _graph_breaks(patched, ids)
    assert patched_breaks == breaks, reasons
    assert not [reason for reason in reasons if "altup_cupy" in reason], reasons
    grad_seed = seeds()
    eager_out, eager_grads = _run(patched, ids, grad_seed)
    patched.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    compiled_out, compiled_grads = _run(torch.compile(patched, backend="aot_eager"), ids, grad_seed)
    torch.testing.assert_close(compiled_out, eager_out, **FP32_TOL)
    compiled_grads = {name.removeprefix("_orig_mod."): g for name, g in compiled_grads.items()}
    assert compiled_grads.keys() == eager_grads.keys()
    for name, g in compiled_grads.items():
        _assert_close_normwise(g, eager_grads[name], name)


def test_torch_compile_of_inference_adds_no_graph_break_and_matches_eager(seeds):
    """The same without gradients (eval and no_grad: prefill, generation), where the layers' last
    step is a plain in-place add: no graph break the unpatched model does not have, fullgraph
    compiles, and the output is eager's."""
    model = _model(seeds()).eval()
    patched = copy.deepcopy(model)
    gemma3n.patch(patched, serve_cpu=True, compiled_min_tokens=0)
    ids = torch.randint(3, 64, (2, 9))
    with torch.no_grad():
        breaks, _ = _graph_breaks(model, ids)
        patched_breaks, reasons = _graph_breaks(patched, ids)
        assert patched_breaks == breaks, reasons
        eager = patched(input_ids=ids).last_hidden_state
        torch._dynamo.reset()
        compiled = torch.compile(patched, backend="aot_eager", fullgraph=True)(input_ids=ids).last_hidden_state
    torch.testing.assert_close(compiled, eager, **FP32_TOL)


def _compiled_operators(model, ids) -> set[str]:
    """The altup_cupy operators in the graphs torch.compile captures of one call of `model`."""
    graphs = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    torch.compile(model, backend=capture)(input_ids=ids)
    torch._dynamo.reset()
    return {str(node.target) for g in graphs for node in g.graph.nodes
            if node.op == "call_function" and "altup_cupy" in str(node.target)}


@pytest.mark.parametrize("class_patch", (False, True))
@pytest.mark.parametrize("threshold", (0, 18, 19))
def test_compiled_calls_below_the_threshold_run_transformers_code(seeds, class_patch, threshold):
    """Under torch.compile a call of fewer than compiled_min_tokens tokens captures transformers'
    code (no altup_cupy operator in the graph); at the threshold and above, every operator. Eager
    calls are served whatever the threshold."""
    model = _model(seeds()).train()
    ids = torch.randint(3, 64, (2, 9))  # 18 tokens
    if class_patch:
        gemma3n.patch(serve_cpu=True, compiled_min_tokens=threshold)
    else:
        gemma3n.patch(model, serve_cpu=True, compiled_min_tokens=threshold)
    operators = _compiled_operators(model, ids)
    if threshold > 18:
        assert operators == set()
    else:
        names = {name.split(".")[1] for name in operators}
        assert {"expand", "collapse"} <= names and any("predict" in n for n in names), operators
        assert any("correct" in n for n in names), operators


def test_eager_calls_are_served_whatever_the_threshold(seeds, op_calls):
    model = _model(seeds()).train()
    gemma3n.patch(model, serve_cpu=True, compiled_min_tokens=10 ** 9)
    model(input_ids=torch.randint(3, 64, (2, 9)))
    assert op_calls == {"predict": 2, "correct": 2, "expand": 1, "collapse": 1}


@pytest.mark.parametrize("threshold", (-1, 1.5, True))
def test_patch_refuses_a_bad_threshold(threshold):
    with pytest.raises(ValueError, match="compiled_min_tokens must be an int >= 0"):
        gemma3n.patch(compiled_min_tokens=threshold)


def test_patch_refuses_other_models():
    with pytest.raises(ValueError, match="no Gemma3nTextAltUp"):
        gemma3n.patch(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        gemma3n.patch("gemma")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("hidden", (2048, 2560))
def test_router_scale_is_the_buffer_value(hidden, dtype):
    """The patch passes the router's input scale as transformers' buffer holds it (in bf16,
    1/2560 is 0.1% off), computed without reading the buffer."""
    module = modeling.Gemma3nTextAltUp(tiny_text_config(hidden=hidden)).to(dtype)
    assert gemma3n._router_scale(module) == module.router_input_scale.item()
