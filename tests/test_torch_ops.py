"""Both ops as torch custom operators: registration, fake implementations, torch.compile, opcheck,
CUDA graphs, and the eager fast path agreeing bit for bit with the dispatcher path.

CPU tests run everywhere (the CPU kernels are the float32 references); GPU tests skip without one.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import altup_cupy
from altup_cupy.lab.workloads import Workload, collapse_inputs, predict_correct_backward_inputs
from altup_cupy.ops.collapse_versions import VERSIONS as COLLAPSE_VERSIONS
from altup_cupy.ops.predict_correct_backward import INPUT_NAMES
from altup_cupy.ops.predict_correct_backward_versions import VERSIONS as BACKWARD_VERSIONS

BF16, F32 = torch.bfloat16, torch.float32


def _collapse_args(n, b, s, h, seed, device):
    inputs = collapse_inputs(Workload("collapse", n, h, b, s, 1e-5, 0.05, 1e-5), seed, device)
    return inputs["hidden_states"], inputs["unembed_projs"], inputs["eps"]


def _backward_args(n, b, s, h, a, seed, device):
    w = Workload("predict_correct_backward", n, h, b, s, 1e-3, 0.05, 1e-6, a)
    inputs = predict_correct_backward_inputs(w, seed, device, "random")
    return [inputs[k] for k in INPUT_NAMES], a, inputs["eps"]


def _assert_bitwise(got, expected, what):
    got = got if isinstance(got, (tuple, list)) else (got,)
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    assert len(got) == len(expected), what
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.dtype == e.dtype and g.shape == e.shape, (what, i, g.dtype, e.dtype, g.shape, e.shape)
        assert torch.equal(g.view(torch.uint8) if g.dim() else g, e.view(torch.uint8) if e.dim() else e), \
            f"{what}: output {i} differs"


# ---- CPU: registration and fake implementations ---------------------------------------------------


def test_ops_are_registered_on_import_without_a_gpu():
    code = ("import torch, altup_cupy, sys; "
            "print(torch.ops.altup_cupy.collapse.default._schema); "
            "print(torch.ops.altup_cupy.predict_correct_backward.default._schema); "
            "print('cupy' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    collapse_schema, backward_schema, cupy_loaded = done.stdout.strip().splitlines()
    assert collapse_schema.startswith("altup_cupy::collapse(Tensor hidden_states, Tensor[] unembed_projs")
    assert backward_schema.startswith("altup_cupy::predict_correct_backward(Tensor grad_corrected")
    assert backward_schema.endswith("-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
    assert cupy_loaded == "False", "importing the package must not import CuPy"


def test_collapse_is_differentiable_on_import():
    """`import altup_cupy` alone registers collapse's backward: no autograd fallback, no warning."""
    code = ("import warnings, torch, altup_cupy; warnings.simplefilter('error'); "
            "h = torch.randn(3, 2, 4, 16, dtype=torch.float64, requires_grad=True); "
            "w = torch.randn(2, 16, 16, dtype=torch.float64, requires_grad=True); "
            "print(torch.autograd.gradcheck(lambda h, w: altup_cupy.collapse(h, w), (h, w)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("listed", [False, True])
def test_collapse_fake_shapes(n, listed):
    hs, ws, eps = _collapse_args(n, 2, 3, 24, 0, "cpu")
    weights = list(ws) if listed else [ws]
    with FakeTensorMode() as mode:
        out = torch.ops.altup_cupy.collapse(mode.from_tensor(hs), [mode.from_tensor(w) for w in weights], eps)
    assert out.shape == (2, 3, 24) and out.dtype == BF16 and out.device == hs.device


@pytest.mark.parametrize("n", [2, 3, 4])
def test_backward_fake_shapes(n):
    args, a, eps = _backward_args(n, 2, 3, 16, n - 1, 0, "cpu")
    with FakeTensorMode() as mode:
        out = torch.ops.altup_cupy.predict_correct_backward(*map(mode.from_tensor, args), a, eps)
    expected = [((n, 2, 3, 16), BF16), ((2, 3, 16), BF16), ((n * n, n), F32), ((n, n), F32),
                ((n, 16), F32), ((16,), F32)]
    assert [(tuple(o.shape), o.dtype) for o in out] == expected


def test_meta_tensors_get_shapes_like_torch_ops():
    hs, ws, eps = _collapse_args(3, 2, 3, 16, 0, "cpu")
    out = altup_cupy.collapse(hs.to("meta"), ws.to("meta"), eps)
    assert out.device.type == "meta" and out.shape == (2, 3, 16) and out.dtype == BF16
    args, a, eps = _backward_args(3, 2, 3, 16, 0, 0, "cpu")
    grads = altup_cupy.predict_correct_backward(*(t.to("meta") for t in args), a, eps)
    assert all(g.device.type == "meta" for g in grads) and grads.grad_router_weight.shape == (3, 16)


def test_fake_path_keeps_the_named_errors():
    hs, ws, eps = _collapse_args(3, 2, 3, 16, 0, "cpu")
    first_stream = hs[0].contiguous()
    with FakeTensorMode() as mode:
        with pytest.raises(ValueError, match=r"hidden_states must be a 4-D tensor \[N, B, S, H\], got a 3-D"):
            torch.ops.altup_cupy.collapse(mode.from_tensor(first_stream), [mode.from_tensor(ws)], eps)
    with pytest.raises(ValueError, match=r"unembed_projs\[1\] must have shape \[16, 16\]"):
        altup_cupy.collapse(hs.to("meta"), [ws[0].to("meta"), ws[1, :8].to("meta")], eps)


@pytest.mark.parametrize("op", ["collapse", "predict_correct_backward"])
def test_compile_fullgraph_on_cpu_is_bitwise_eager(op):
    if op == "collapse":
        args = _collapse_args(3, 2, 5, 32, 1, "cpu")
        fn = altup_cupy.collapse
    else:
        tensors, a, eps = _backward_args(3, 2, 5, 32, 1, 1, "cpu")
        args = (*tensors, a, eps)
        fn = altup_cupy.predict_correct_backward
    compiled = torch.compile(lambda *xs: tuple(fn(*xs)) if op != "collapse" else fn(*xs), fullgraph=True)
    _assert_bitwise(compiled(*args), tuple(fn(*args)) if op != "collapse" else fn(*args), f"{op} compiled")


def test_backward_compiled_with_a_changing_active_idx_is_bitwise_eager():
    """Another active_idx recompiles the function with the index symbolic: it must trace."""
    tensors, _, eps = _backward_args(3, 2, 5, 32, 0, 3, "cpu")
    compiled = torch.compile(lambda *xs, a: tuple(altup_cupy.predict_correct_backward(*xs, a, eps)), fullgraph=True)
    torch._dynamo.reset()
    try:
        for a in (0, 1, 2):
            _assert_bitwise(compiled(*tensors, a=a), tuple(altup_cupy.predict_correct_backward(*tensors, a, eps)),
                            f"active_idx {a}")
    finally:
        torch._dynamo.reset()


def test_opcheck_on_cpu():
    hs, ws, eps = _collapse_args(3, 2, 5, 32, 2, "cpu")
    torch.library.opcheck(torch.ops.altup_cupy.collapse.default, (hs, [ws], eps))
    torch.library.opcheck(torch.ops.altup_cupy.collapse.default, (hs, list(ws), eps))
    args, a, eps = _backward_args(3, 2, 5, 32, 2, 2, "cpu")
    torch.library.opcheck(torch.ops.altup_cupy.predict_correct_backward.default, (*args, a, eps))


# ---- GPU ---------------------------------------------------------------------------------------

# Three shapes each: an odd H (a multiple of 8 but not of 64), M = 1, and a benchmark-sized one.
COLLAPSE_SHAPES = [(3, 1, 7, 1000), (4, 1, 1, 2048), (3, 2, 256, 3072)]
BACKWARD_SHAPES = [(3, 1, 7, 1000), (4, 1, 1, 2048), (3, 2, 256, 2304)]


def _collapse_gpu(shape, seed):
    n, b, s, h = shape
    return _collapse_args(n, b, s, h, seed, "cuda")


def _backward_gpu(shape, seed):
    n, b, s, h = shape
    tensors, a, eps = _backward_args(n, b, s, h, n - 1, seed, "cuda")
    return (*tensors, a, eps)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", COLLAPSE_SHAPES)
def test_collapse_opcheck_gpu(shape, seeds):
    hs, ws, eps = _collapse_gpu(shape, seeds())
    torch.library.opcheck(torch.ops.altup_cupy.collapse.default, (hs, [ws], eps))
    torch.library.opcheck(torch.ops.altup_cupy.collapse.default, (hs, list(ws), eps))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", BACKWARD_SHAPES)
def test_backward_opcheck_gpu(shape, seeds):
    torch.library.opcheck(torch.ops.altup_cupy.predict_correct_backward.default, _backward_gpu(shape, seeds()))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", COLLAPSE_SHAPES)
def test_collapse_fast_path_equals_dispatcher_path(shape, seeds):
    hs, ws, eps = _collapse_gpu(shape, seeds())
    _assert_bitwise(altup_cupy.collapse(hs, ws, eps), torch.ops.altup_cupy.collapse(hs, [ws], eps), "collapse")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", BACKWARD_SHAPES)
def test_backward_fast_path_equals_dispatcher_path(shape, seeds):
    args = _backward_gpu(shape, seeds())
    _assert_bitwise(tuple(altup_cupy.predict_correct_backward(*args)),
                    torch.ops.altup_cupy.predict_correct_backward(*args), "backward")


def _calls():
    return {
        "collapse": (COLLAPSE_SHAPES, _collapse_gpu, lambda hs, ws, eps: altup_cupy.collapse(hs, ws, eps)),
        "predict_correct_backward": (BACKWARD_SHAPES, _backward_gpu,
                                     lambda *args: tuple(altup_cupy.predict_correct_backward(*args))),
    }


CASES = [(op, shape) for op, (shapes, _, _) in _calls().items() for shape in shapes]


@pytest.mark.gpu
@pytest.mark.parametrize("op,shape", CASES)
def test_compile_fullgraph_bitwise_gpu(op, shape, seeds):
    _, make, fn = _calls()[op]
    args = make(shape, seeds())
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    _assert_bitwise(compiled(*args), fn(*args), f"{op} {shape} compiled")


@pytest.mark.gpu
@pytest.mark.parametrize("op,shape", CASES)
def test_cuda_graph_capture_and_replay_bitwise(op, shape, seeds):
    """Captured after warm-up on a side stream, replayed on fresh inputs copied into the captured
    buffers: equal bit for bit to eager calls, and no CuPy memory-pool allocation in the capture."""
    import cupy

    _, make, fn = _calls()[op]
    static = make(shape, seeds())
    tensors = [x for x in static if isinstance(x, torch.Tensor)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    pool_before = cupy.get_default_memory_pool().used_bytes()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn(*static)
    assert cupy.get_default_memory_pool().used_bytes() == pool_before, "CuPy allocated during capture"
    for round_ in range(2):
        fresh = make(shape, seeds())
        for target, source in zip(tensors, (x for x in fresh if isinstance(x, torch.Tensor))):
            target.copy_(source)
        graph.replay()
        torch.cuda.synchronize()
        _assert_bitwise(captured, fn(*static), f"{op} {shape} replay {round_}")


@pytest.mark.gpu
@pytest.mark.parametrize("op,shape", CASES)
def test_compile_reduce_overhead_bitwise(op, shape, seeds):
    _, make, fn = _calls()[op]
    torch._dynamo.reset()
    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    for round_ in range(3):  # warm-up, record, then replays of the CUDA graph
        args = make(shape, seeds())
        got = compiled(*args)
        got = tuple(t.clone() for t in got) if isinstance(got, tuple) else got.clone()
        _assert_bitwise(got, fn(*args), f"{op} {shape} reduce-overhead round {round_}")


def _assert_replay_is_eager(fn, what):
    """fn() captured into a CUDA graph (after one eager call: compiled and planned outside the
    capture) and replayed gives an eager call's bits."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    graph.replay()
    torch.cuda.synchronize()
    _assert_bitwise(captured, fn(), what)


@pytest.mark.gpu
@pytest.mark.parametrize("version", sorted(COLLAPSE_VERSIONS))
def test_collapse_every_version_captures(version, seeds):
    hs, ws, eps = _collapse_gpu(COLLAPSE_SHAPES[0], seeds())
    _assert_replay_is_eager(lambda: altup_cupy.collapse(hs, ws, eps, version=version), f"collapse v{version} graph")


@pytest.mark.gpu
@pytest.mark.parametrize("version", sorted(BACKWARD_VERSIONS))
def test_backward_every_version_captures(version, seeds):
    args = _backward_gpu(BACKWARD_SHAPES[0], seeds())
    from altup_cupy._device import facts

    chosen = BACKWARD_VERSIONS[version]
    if not chosen.runs_on(facts(torch.cuda.current_device())[0], args[0].shape[0], args[0].shape[-1]):
        pytest.skip(f"version {version} does not run on this GPU and shape")
    _assert_replay_is_eager(lambda: tuple(altup_cupy.predict_correct_backward(*args, version=version)),
                            f"backward v{version} graph")
