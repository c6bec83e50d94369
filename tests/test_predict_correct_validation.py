"""CPU: every bad input of predict_correct_backward raises TypeError/ValueError naming the argument."""

from __future__ import annotations

import numpy
import pytest
import torch

from altup_cupy import predict_correct_backward
from altup_cupy.lab.workloads import Workload, predict_correct_backward_inputs
from altup_cupy.ops.predict_correct_backward_versions import (PREFERENCE, V6_RING, VERSIONS, ring_launch_plan,
                                                              v4_launch_plan, v4_supported, v6_supported)
from altup_cupy.reference import predict_correct_backward_reference

N, B, S, H = 3, 2, 3, 16


def good(n=N, b=B, s=S, h=H):
    bf = torch.bfloat16
    return dict(
        grad_corrected=torch.zeros(n, b, s, h, dtype=bf),
        hidden_states=torch.zeros(n, b, s, h, dtype=bf),
        activated=torch.zeros(b, s, h, dtype=bf),
        prediction_coefs=torch.zeros(n * n, n, dtype=bf),
        correction_coefs=torch.zeros(n, n, dtype=bf),
        router_weight=torch.zeros(n, h, dtype=bf),
        norm_weight=torch.zeros(h, dtype=bf),
    )


ARGS = tuple(good())


@pytest.mark.parametrize("name", ARGS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_wrong_dtype(name, dtype):
    """float16 is refused everywhere; float32 among bf16 tensors is a mix of dtypes (the CPU
    reference takes float32 only when every tensor is float32)."""
    kw = good()
    kw[name] = kw[name].to(dtype)
    if name == "grad_corrected" and dtype == torch.float32:
        name = "hidden_states"  # grad_corrected sets the call's dtype: the next tensor disagrees
    with pytest.raises(TypeError, match=name):
        predict_correct_backward(**kw)


BAD_SHAPES = {
    "grad_corrected": [(N, B, S), (N, B, S, H, 1)],
    "hidden_states": [(N + 1, B, S, H), (N, B + 1, S, H), (N, B, S + 1, H), (N, B, S, H + 8)],
    "activated": [(B + 1, S, H), (B, S, H + 8), (N, B, S, H)],
    "prediction_coefs": [(N, N), (N * N, N + 1), (N * N + 1, N)],
    "correction_coefs": [(N, N + 1), (N * N, N)],
    "router_weight": [(N + 1, H), (N, H + 8), (H,)],
    "norm_weight": [(H + 8,), (1, H)],
}


@pytest.mark.parametrize("name,shape", [(k, s) for k, v in BAD_SHAPES.items() for s in v])
def test_wrong_shape(name, shape):
    kw = good()
    kw[name] = torch.zeros(shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=name):
        predict_correct_backward(**kw)


@pytest.mark.parametrize("n", [1, 5])
def test_unsupported_streams(n):
    with pytest.raises(ValueError, match="grad_corrected"):
        predict_correct_backward(**good(n=n))


@pytest.mark.parametrize("h,rule", [(12, "positive and divisible by 8"), (0, "positive and divisible by 8"),
                                    (8200, "at most 8192"), (16384, "at most 8192")])
def test_unsupported_hidden(h, rule):
    with pytest.raises(ValueError, match=rf"hidden size H \(grad_corrected dim 3\) must be {rule}, got {h}"):
        predict_correct_backward(**good(h=h))


@pytest.mark.parametrize("name", ARGS)
def test_non_contiguous(name):
    kw = good()
    t = kw[name]
    if t.dim() == 1:
        t = torch.zeros(2 * t.shape[0], dtype=t.dtype)[::2]
    else:
        t = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if t.is_contiguous():  # a square [N, N]: transpose twice is contiguous; slice instead
        t = torch.zeros(*kw[name].shape[:-1], 2 * kw[name].shape[-1], dtype=t.dtype)[..., ::2]
    kw[name] = t
    with pytest.raises(ValueError, match=name):
        predict_correct_backward(**kw)


VECTOR_ARGS = ("grad_corrected", "hidden_states", "activated", "router_weight", "norm_weight")


@pytest.mark.gpu
@pytest.mark.parametrize("name", VECTOR_ARGS)
def test_misaligned(name):
    """A contiguous view that starts 2 bytes into its storage: the kernels' 16-byte accesses
    would fault, so it is refused with the argument's name."""
    kw = {k: v.cuda() for k, v in good().items()}
    t = kw[name]
    kw[name] = torch.zeros(t.numel() + 1, dtype=t.dtype, device="cuda")[1:].view(t.shape)
    assert kw[name].is_contiguous() and kw[name].data_ptr() % 16
    with pytest.raises(ValueError, match=f"{name} must start at a 16-byte aligned address"):
        predict_correct_backward(**kw)


@pytest.mark.parametrize("n,h,stages", [(3, 2304, 6), (4, 2048, 5), (4, 2560, 4), (2, 2560, 6), (3, 8, 6)])
def test_v4_launch_plan(n, h, stages):
    """The most ring stages (at most 6) that fit one block's 227 KiB of shared memory; H <= 2560."""
    assert v4_supported(n, h)
    assert v4_launch_plan(n, h) == stages


@pytest.mark.parametrize("n,h", [(2, 2568), (3, 3072), (4, 8192)])
def test_v4_refuses_shapes_it_cannot_hold(n, h):
    assert not v4_supported(n, h)
    with pytest.raises(ValueError, match="version 3"):
        v4_launch_plan(n, h)


@pytest.mark.parametrize("n,h,stages", [(3, 2304, 6), (2, 2432, 6), (2, 8, 6)])
def test_v6_launch_plan(n, h, stages):
    """v6: the same ring in shared memory, half slices: H <= 2432 (20 warps), N <= 3."""
    assert v6_supported(n, h)
    assert ring_launch_plan(V6_RING, n, h) == stages


@pytest.mark.parametrize("n,h", [(4, 2048), (3, 2440), (2, 4096)])
def test_v6_refuses_shapes_it_cannot_hold(n, h):
    assert not v6_supported(n, h)
    with pytest.raises(ValueError, match="version 4 .* or 3"):
        ring_launch_plan(V6_RING, n, h)


@pytest.mark.parametrize("stages", [2, 7])
def test_v4_stage_count_that_does_not_fit(stages):
    with pytest.raises(ValueError, match="does not fit"):
        v4_launch_plan(3, 2304, stages=stages)


@pytest.mark.parametrize("a", [-1, N, 7])
def test_active_idx_out_of_range(a):
    with pytest.raises(ValueError, match="active_idx"):
        predict_correct_backward(**good(), active_idx=a)


@pytest.mark.parametrize("a", [1.0, "0", None, True, torch.tensor(1), torch.tensor(True)])
def test_active_idx_not_int(a):
    with pytest.raises(TypeError, match="active_idx"):
        predict_correct_backward(**good(), active_idx=a)


@pytest.mark.parametrize("eps", [0.0, -1e-6, float("nan"), float("inf")])
def test_bad_eps(eps):
    with pytest.raises(ValueError, match="eps"):
        predict_correct_backward(**good(), eps=eps)


def test_eps_not_a_number():
    with pytest.raises(TypeError, match="eps"):
        predict_correct_backward(**good(), eps="small")


def test_cpu_tensors_run_the_float32_reference(seeds):
    w = Workload("predict_correct_backward", 3, 64, 2, 5, 1e-3, 0.05, 1e-6, 1)
    inputs = predict_correct_backward_inputs(w, seeds(), "cpu", "random")
    args = [inputs[k] for k in ARGS]
    out = predict_correct_backward(*args, 1, w.eps)
    expected = predict_correct_backward_reference(*args, 1, w.eps, torch.float32)
    for got, ref in zip(out, expected):
        assert torch.equal(got, ref.to(got.dtype))


def test_tensors_on_two_devices_are_named():
    kw = good()
    kw["router_weight"] = kw["router_weight"].to("meta")
    with pytest.raises(ValueError, match="router_weight is on meta but grad_corrected is on cpu"):
        predict_correct_backward(**kw)


@pytest.mark.parametrize("name,expected_rank,rank", [("grad_corrected", 4, 3), ("activated", 3, 2),
                                                   ("norm_weight", 1, 2)])
def test_wrong_rank_names_argument_and_ranks(name, expected_rank, rank):
    kw = good()
    kw[name] = torch.zeros((4,) * rank, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"{name} must be a {expected_rank}-D tensor .* got a {rank}-D tensor"):
        predict_correct_backward(**kw)


@pytest.mark.parametrize("name", ARGS)
def test_numpy_rejected(name):
    kw = good()
    kw[name] = numpy.zeros(kw[name].shape, dtype=numpy.float32)
    with pytest.raises(TypeError, match=name):
        predict_correct_backward(**kw)


def test_the_default_preference_is_pinned():
    """The default (v4 on Hopper where it applies, else v3) moves only with a benchmark behind it:
    a change here is deliberate (CONTRIBUTING, "PREFERENCE")."""
    assert PREFERENCE == (4, 3)


def test_bad_version():
    with pytest.raises(ValueError, match="version"):
        predict_correct_backward(**good(), version=max(VERSIONS) + 1)
    for not_an_int in (1.0, True):  # both equal 1: a lookup alone would take them
        with pytest.raises(TypeError, match="version must be None or an int"):
            predict_correct_backward(**good(), version=not_an_int)
    predict_correct_backward(**good(), version=numpy.int64(min(VERSIONS)))  # an integer, if not Python's


@pytest.mark.gpu
def test_mixed_devices_and_frameworks():
    import cupy

    kw = {k: v.cuda() for k, v in good().items()}
    kw["norm_weight"] = kw["norm_weight"].cpu()
    with pytest.raises(ValueError, match="norm_weight"):
        predict_correct_backward(**kw)
    kw = {k: v.cuda() for k, v in good().items()}
    kw["activated"] = cupy.asarray(kw["activated"])
    with pytest.raises(TypeError, match="activated"):
        predict_correct_backward(**kw)


@pytest.mark.gpu
@pytest.mark.parametrize("version", [None, *VERSIONS])
def test_zero_tokens(version):
    kw = {k: v.cuda() for k, v in good(b=0).items()}
    out = predict_correct_backward(**kw, version=version)
    assert out.grad_hidden_states.shape == (N, 0, S, H) and out.grad_hidden_states.dtype == torch.bfloat16
    assert out.grad_activated.shape == (0, S, H)
    for t, shape in zip(out[2:], [(N * N, N), (N, N), (N, H), (H,)]):
        assert t.shape == shape and t.dtype == torch.float32 and t.is_cuda
        assert bool((t == 0).all())


def test_cpu_float16_names_the_dtypes_the_cpu_takes():
    kw = {name: t.half() for name, t in good().items()}
    with pytest.raises(TypeError, match="grad_corrected must have dtype bfloat16, float32 or float64 on the CPU, "
                                        "got float16"):
        predict_correct_backward(**kw)
