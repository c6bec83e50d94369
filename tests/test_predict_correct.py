"""GPU: predict_correct_backward (every version) against the float64 reference."""

from __future__ import annotations

import functools

import pytest
import torch

from altup_cupy import predict_correct_backward
from altup_cupy.lab.benchmarks.predict_correct_backward import ARG_NAMES, eager_fp32
from altup_cupy.lab.check import oracle_bound
from altup_cupy.lab.workloads import Workload, predict_correct_backward_inputs, tolerance_report, workloads
from altup_cupy.ops.predict_correct_backward import PredictCorrectGrads, run_plan
from altup_cupy.ops.predict_correct_backward_versions import RINGS, VERSIONS, ring_plan, ring_stage_choices
from altup_cupy.reference import predict_correct_backward_reference

pytestmark = pytest.mark.gpu

BENCH = workloads("predict_correct_backward", "benchmark")
OUT_DTYPES = (torch.bfloat16, torch.bfloat16) + (torch.float32,) * 4


def _args(inputs):
    return [inputs[k] for k in ARG_NAMES]


def _expected_shapes(n, b, s, h):
    return [(n, b, s, h), (b, s, h), (n * n, n), (n, n), (n, h), (h,)]


def check_against_reference(w: Workload, inputs, out, label=""):
    args, a, eps = _args(inputs), inputs["active_idx"], inputs["eps"]
    ref64 = predict_correct_backward_reference(*args, a, eps)
    ref32 = eager_fp32(*args, active_idx=a, eps=eps)
    n, b, s, h = inputs["grad_corrected"].shape
    for name, o, r64, r32, dt, shape in zip(ref64._fields, out, ref64, ref32, OUT_DTYPES,
                                           _expected_shapes(n, b, s, h)):
        assert o.dtype == dt, (label, name, o.dtype)
        assert tuple(o.shape) == shape, (label, name, tuple(o.shape))
        rep = tolerance_report(o, r64, w.atol, w.rtol)
        base = tolerance_report(r32, r64, w.atol, w.rtol)
        assert rep.passed, (label, name, rep)
        assert rep.rel_l2 <= oracle_bound(base.rel_l2), (label, name, rep.rel_l2, base.rel_l2)


@pytest.mark.parametrize("norm_weight", ["ones", "random"])
@pytest.mark.parametrize("w", BENCH, ids=[w.label for w in BENCH])
def test_benchmark_workloads(w, norm_weight, seeds):
    for round_ in range(3):
        inputs = predict_correct_backward_inputs(w, seeds(), "cuda", norm_weight)
        out = predict_correct_backward(*_args(inputs), inputs["active_idx"], inputs["eps"])
        check_against_reference(w, inputs, out, f"round {round_}")


def _small(n, h, b, s, a=0, atol=0.0075):
    return Workload("predict_correct_backward", n, h, b, s, atol, 0.05, 1e-6, a)


def test_capped_dispatch_picks_the_portable_default(monkeypatch):
    """ALTUP_MAX_COMPUTE_CAPABILITY=80 makes the default what an sm_80 GPU runs (v3), while an
    explicit version still runs what this GPU can."""
    from altup_cupy import _device
    from altup_cupy.ops import predict_correct_backward as op

    index = torch.cuda.current_device()
    op._version.cache_clear()
    monkeypatch.setenv(_device.DISPATCH_CAP_VARIABLE, "80")
    try:
        assert op._version(None, 3, 2304, index).number == 3
        if _device.facts(index)[0] >= 90:
            assert op._version(4, 3, 2304, index).number == 4
    finally:
        op._version.cache_clear()


@pytest.mark.parametrize("a", [1, 2])
@pytest.mark.parametrize("version", VERSIONS)
def test_active_idx(a, version, seeds):
    w = _small(3, 2304, 4, 256, a)
    inputs = predict_correct_backward_inputs(w, seeds(), "cuda", "random")
    out = predict_correct_backward(*_args(inputs), a, inputs["eps"], version=version)
    check_against_reference(w, inputs, out)


def _ring_refuses(n, h, version, inputs, a):
    """A version asked for a shape it does not serve (a ring kernel where its shared-memory ring or
    its slices per thread do not fit, or an N it is not built for): a clear ValueError, not a launch."""
    if VERSIONS[version].supports(n, h):
        return False
    assert version in RINGS, (version, n, h)
    with pytest.raises(ValueError, match=f"version {version} does not serve N = {n}, H = {h}"):
        predict_correct_backward(*_args(inputs), a, inputs["eps"], version=version)
    return True


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("h", [8, 40, 2048, 2560, 3072, 4096, 4104, 8192])
@pytest.mark.parametrize("version", VERSIONS)
def test_streams_and_hidden(n, h, version, seeds):
    w = _small(n, h, 2, 300, a=n - 1)
    inputs = predict_correct_backward_inputs(w, seeds(), "cuda", "random")
    if _ring_refuses(n, h, version, inputs, n - 1):
        return
    out = predict_correct_backward(*_args(inputs), n - 1, inputs["eps"], version=version)
    check_against_reference(w, inputs, out)


RING_PLAN_CASES = [(version, n, h, stages) for version, ring in RINGS.items()
                   for n, h in [(3, 2304), (4, 2048), (4, 2560), (2, 1024), (3, 2432)]
                   for stages in ring_stage_choices(ring, n, h)]


@pytest.mark.parametrize("version,n,h,stages", RING_PLAN_CASES,
                         ids=[f"v{v}-N{n}-H{h}-{s}stages" for v, n, h, s in RING_PLAN_CASES])
def test_ring_every_stage_count(version, n, h, stages, seeds):
    """Every ring-stage count that fits, on enough tokens that each block's ring wraps several
    times (both mbarrier phases), with a ragged last round of tokens."""
    w = _small(n, h, 7, 311, a=1)
    inputs = predict_correct_backward_inputs(w, seeds(), "cuda", "random")
    out = run_plan(functools.partial(ring_plan, RINGS[version], stages=stages), _args(inputs), 1, inputs["eps"])
    check_against_reference(w, inputs, out)


@pytest.mark.parametrize("n,h", [(3, 2304), (4, 2560), (2, 2048)])
@pytest.mark.parametrize("version", VERSIONS)
def test_one_token(n, h, version, seeds):
    w = _small(n, h, 1, 1, atol=0.0014)
    inputs = predict_correct_backward_inputs(w, seeds(), "cuda", "random")
    if _ring_refuses(n, h, version, inputs, 0):
        return
    out = predict_correct_backward(*_args(inputs), 0, inputs["eps"], version=version)
    check_against_reference(w, inputs, out)


@pytest.mark.parametrize("n,h", [(3, 2304), (4, 2560), (3, 8192)])
@pytest.mark.parametrize("version", VERSIONS)
def test_versions_agree_and_are_deterministic(n, h, version, seeds):
    w = _small(n, h, 8, 373)
    inputs = predict_correct_backward_inputs(w, seeds(), "cuda", "random")
    if _ring_refuses(n, h, version, inputs, 0):
        return
    first = predict_correct_backward(*_args(inputs), 0, inputs["eps"], version=version)
    again = predict_correct_backward(*_args(inputs), 0, inputs["eps"], version=version)
    default = predict_correct_backward(*_args(inputs), 0, inputs["eps"])
    for x, y, z in zip(first, again, default):
        assert torch.equal(x.view(torch.uint8) if x.dtype == torch.bfloat16 else x.view(torch.int32),
                           y.view(torch.uint8) if y.dtype == torch.bfloat16 else y.view(torch.int32))
        rel = ((x.double() - z.double()).norm() / z.double().norm()).item()
        assert rel < 1e-2, rel


@pytest.mark.parametrize("version", VERSIONS)
def test_poisoned_outputs_and_inputs_unchanged(version, seeds):
    """Fill the caching allocator's blocks of the output sizes with NaN, free them, then call:
    the outputs (and workspaces) reuse poisoned memory, so any element left unwritten shows."""
    w = _small(3, 2304, 4, 293)
    inputs = predict_correct_backward_inputs(w, seeds(), "cuda", "random")
    before = {k: v.clone() for k, v in inputs.items() if torch.is_tensor(v)}
    n, b, s, h = inputs["grad_corrected"].shape
    torch.cuda.synchronize()
    poison = [torch.full(shape, float("nan"), dtype=dt, device="cuda")
              for shape, dt in zip(_expected_shapes(n, b, s, h), OUT_DTYPES)]
    poison += [torch.full((1 << 26,), float("nan"), dtype=torch.float32, device="cuda")]
    ptrs = {p.data_ptr() for p in poison}
    del poison
    out = predict_correct_backward(*_args(inputs), 0, inputs["eps"], version=version)
    assert out.grad_hidden_states.data_ptr() in ptrs  # the poisoning really hit the output
    for o in out:
        assert bool(torch.isfinite(o.float()).all())
    check_against_reference(w, inputs, out)
    for k, v in before.items():
        assert torch.equal(inputs[k].view(torch.uint8) if v.dtype == torch.bfloat16 else inputs[k],
                           v.view(torch.uint8) if v.dtype == torch.bfloat16 else v), k


def test_cupy_in_cupy_out(seeds):
    import cupy

    w = _small(3, 2304, 2, 128)
    inputs = predict_correct_backward_inputs(w, seeds(), "cuda", "random")
    cp_args = [cupy.from_dlpack(t) for t in _args(inputs)]
    out = predict_correct_backward(*cp_args, 0, inputs["eps"])
    assert all(isinstance(o, cupy.ndarray) for o in out)
    assert [str(o.dtype) for o in out] == ["bfloat16"] * 2 + ["float32"] * 4
    torch_out = [torch.from_dlpack(o) for o in out]
    check_against_reference(w, inputs, torch_out)


@pytest.mark.parametrize("version", VERSIONS)
def test_caller_stream(version, seeds):
    """The inputs are written on a side stream after a GPU-side delay; the call, made on that stream
    without synchronising, must see them (on any other stream it would read zeros)."""
    w = _small(3, 2304, 4, 256)
    inputs = predict_correct_backward_inputs(w, seeds(), "cuda", "random")
    sources = _args(inputs)
    targets = [torch.zeros_like(t) for t in sources]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on `side`
        for target, source in zip(targets, sources):
            target.copy_(source)
        out = predict_correct_backward(*targets, 0, inputs["eps"], version=version)
    side.synchronize()
    check_against_reference(w, inputs, out)


def test_past_2_31_elements():
    """N = 3, H = 2304, 320000 tokens: 2.2e9 elements per [N, M, H] tensor."""
    n, h, b, s = 3, 2304, 1, 320000
    w = _small(n, h, b, s, atol=0.015)
    inputs = predict_correct_backward_inputs(w, 1234, "cuda", "random")
    assert n * b * s * h > 2**31
    out = predict_correct_backward(*_args(inputs), 0, inputs["eps"])
    args = _args(inputs)
    # chunked float64 reference: weight gradients summed over chunks, activation rows sampled
    weight_ref = None
    cross = 2**31 // h - 2 * s  # stream 2's row holding flat element 2^31 of [N, M, H]
    sample = torch.tensor([0, 1, 77777, cross - 1, cross, cross + 1, s - 2, s - 1], device="cuda")
    for first in range(0, s, 8192):
        sl = slice(first, min(s, first + 8192))
        chunk = [args[0][:, :, sl], args[1][:, :, sl], args[2][:, sl], *args[3:]]
        ref = predict_correct_backward_reference(*chunk, 0, inputs["eps"])
        weight_ref = list(ref[2:]) if weight_ref is None else [x + y for x, y in zip(weight_ref, ref[2:])]
        in_chunk = sample[(sample >= sl.start) & (sample < sl.stop)]
        for t in in_chunk.tolist():
            loc = t - sl.start
            r = tolerance_report(out.grad_hidden_states[:, :, t], ref.grad_hidden_states[:, :, loc], 0.015, 0.05)
            assert r.passed and r.rel_l2 < 1e-2, (t, r)
            r = tolerance_report(out.grad_activated[:, t], ref.grad_activated[:, loc], 0.015, 0.05)
            assert r.passed and r.rel_l2 < 1e-2, (t, r)
    for o, r in zip(out[2:], weight_ref):
        rep = tolerance_report(o, r, 0.015, 0.05)
        assert rep.passed and rep.rel_l2 < 1e-3, rep


@pytest.mark.parametrize("version", VERSIONS)
def test_the_reduction_reads_this_calls_partials(version, seeds):
    """On Hopper the reduction is a programmatic dependent launch, placed on an SM as soon as a
    block of the kernel before it ends: it must wait for that whole kernel. With one token more
    than a whole number of rounds over the SMs, block 0 works a token longer than the rest, so a
    reduction that did not wait would read block 0's partial row before it is written: the row
    the call before left in the same scratch. Each call made twice, alone (the row left there is
    its own), gives the expected bits; calls of other inputs queued back to back must give them
    too."""
    from altup_cupy import _device
    from altup_cupy.ops.predict_correct_backward_versions import _Reduce

    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert _Reduce(3, 2304).launch.programmatic == hopper
    w = _small(3, 2304, 1, 24 * _device.sm_count(torch.cuda.current_device()) + 1)
    calls = [predict_correct_backward_inputs(w, seeds(), "cuda", "random") for _ in range(6)]
    call = lambda inputs: predict_correct_backward(*_args(inputs), 0, inputs["eps"], version=version)  # noqa: E731
    if _ring_refuses(3, 2304, version, calls[0], 0):
        return
    alone = []
    for inputs in calls:
        call(inputs)
        torch.cuda.synchronize()
        alone.append([t.clone() for t in call(inputs)[2:]])
        torch.cuda.synchronize()
    queued = [[t.clone() for t in call(inputs)[2:]] for inputs in calls]
    for k, (expected, got) in enumerate(zip(alone, queued)):
        for name, x, y in zip(PredictCorrectGrads._fields[2:], expected, got):
            assert torch.equal(x.view(torch.int32), y.view(torch.int32)), (k, name)
