"""The AltUp collapse forward (docs/SPEC.md section 1): N streams merged into one hidden state.

`collapse(...)` is the public function; `torch.ops.altup_cupy.collapse` the torch operator
behind it, registered through `_operators` (fake implementation for torch.compile, the kernels on
CUDA, the float32 reference on the CPU). Eager calls on CUDA tensors that need no autograd take the fast path: the
validated inputs go straight to the cached launch plan of their shape, skipping the dispatcher's
Python layers (the result is the same kernels' on the same stream).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .. import _arrays, _device
from .._operators import operator
from ..reference import collapse_reference
from . import _registry
from ._registry import fast_path_applies
from .collapse_versions import PREFERENCE, VERSIONS

BF16 = torch.bfloat16


def validate(hidden_states: torch.Tensor, unembed_projs: Sequence[torch.Tensor], eps: Any,
             launching: bool = False):
    """Named errors for anything the kernels cannot take; returns (N, B, S, H, device, eps).
    launching: the tensors are about to be read by the kernels (real CUDA memory), so their
    addresses are checked too. The kernels take bf16; the CPU reference also float32 and float64
    (autograd checks in float64 run through it)."""
    dtype = _arrays.call_dtype("hidden_states", hidden_states)
    _arrays.check_tensor("hidden_states", hidden_states, dtype, (None, None, None, None), "N B S H")
    streams, batch, seq, hidden = hidden_states.shape
    _arrays.check_streams_and_width("hidden_states", streams, hidden)
    named = [("hidden_states", hidden_states)]
    if len(unembed_projs) == 1 and unembed_projs[0].dim() == 3:
        _arrays.check_tensor("unembed_projs", unembed_projs[0], dtype, (streams - 1, hidden, hidden),
                             "N-1 H H")
        named.append(("unembed_projs", unembed_projs[0]))
    else:
        if len(unembed_projs) != streams - 1:
            raise ValueError(f"unembed_projs must hold N-1 = {streams - 1} matrices for N = {streams} "
                             f"streams, got {len(unembed_projs)}")
        for i, w in enumerate(unembed_projs):
            _arrays.check_tensor(f"unembed_projs[{i}]", w, dtype, (hidden, hidden), "H H")
            named.append((f"unembed_projs[{i}]", w))
    eps = _arrays.positive_finite("eps", eps)
    device = _arrays.check_devices(named)
    if launching:
        _arrays.check_aligned(named[:1])
    return streams, batch, seq, hidden, device, eps


def check_stacked(unembed_projs: torch.Tensor) -> None:
    """The N-1 matrices passed as one tensor: stacked, [N-1, H, H]."""
    if unembed_projs.dim() != 3:
        raise ValueError("unembed_projs must be a 3-D tensor [N-1, H, H] (or a list of N-1 [H, H] matrices), got a "
                         f"{unembed_projs.dim()}-D tensor of shape {list(unembed_projs.shape)}")


# The version that serves a call, picked once per shape (it caches its own plans).
_version = _registry.picker(VERSIONS, PREFERENCE)


def _run_cuda(hidden_states, unembed_projs, eps, version, fast_path=False):
    """fast_path: called by the public function, outside torch's dispatcher: scratch memory is
    reused (see _scratch)."""
    streams, batch, seq, hidden, device, eps = validate(hidden_states, unembed_projs, eps, launching=True)
    out = torch.empty((batch, seq, hidden), dtype=BF16, device=device)
    rows = batch * seq
    if rows == 0:
        return out
    index = device.index
    stacked = unembed_projs[0].dim() == 3
    plan = _version(version, streams, hidden, index).plan(streams, rows, hidden, stacked, index)
    plan((hidden_states, *unembed_projs), (out,), (eps,), torch._C._cuda_getCurrentRawStream(index), fast_path)
    return out


@operator("collapse(Tensor hidden_states, Tensor[] unembed_projs, float eps, SymInt? version=None) -> Tensor")
def collapse_op(hidden_states: torch.Tensor, unembed_projs: list[torch.Tensor], eps: float,
                version: int | None = None) -> torch.Tensor:
    """The kernels on CUDA tensors; the reference on CPU tensors."""
    if hidden_states.is_cuda:
        with _device.on(hidden_states.device):
            return _run_cuda(hidden_states, unembed_projs, eps, version)
    validate(hidden_states, unembed_projs, eps)
    _registry.check_number(VERSIONS, version)
    weights = unembed_projs[0] if len(unembed_projs) == 1 and unembed_projs[0].dim() == 3 else unembed_projs
    compute = torch.float32 if hidden_states.dtype == BF16 else hidden_states.dtype
    return collapse_reference(hidden_states, weights, eps, compute).to(hidden_states.dtype)


@collapse_op.register_fake
def _collapse_fake(hidden_states, unembed_projs, eps, version=None):
    streams, batch, seq, hidden, device, _ = validate(hidden_states, unembed_projs, eps)
    _registry.check_number(VERSIONS, version)
    return hidden_states.new_empty((batch, seq, hidden))


def collapse(hidden_states: Any, unembed_projs: Sequence[Any] | Any, eps: float = 1e-5, *,
             version: int | None = None) -> Any:
    """Merge N AltUp streams into one hidden state.

    hidden_states: bf16 [N, B, S, H]; unembed_projs: N-1 bf16 [H, H] matrices (nn.Linear layout,
    y = x @ W^T), as a list or one stacked [N-1, H, H] tensor; eps clamps the mean square of each
    projection. Returns bf16 [B, S, H]: a torch tensor for torch inputs, a CuPy array for CuPy
    inputs, computed on the caller's current stream. CPU tensors run the reference: bf16, float32 or
    float64, every tensor in one dtype, computed in float32 (float64 for float64 inputs).
    version None (default): the fastest version for this GPU and shape (see `VERSIONS`).
    """
    listed = isinstance(unembed_projs, (list, tuple))
    raw = list(unembed_projs) if listed else [unembed_projs]
    names = ([f"unembed_projs[{i}]" for i in range(len(raw))] if listed else ["unembed_projs"])
    cupy_in = _arrays.check_framework([("hidden_states", hidden_states), *zip(names, raw)])
    hs = _arrays.as_tensor("hidden_states", hidden_states)
    weights = [_arrays.as_tensor(n, w) for n, w in zip(names, raw)]
    if not listed:
        check_stacked(weights[0])
    # Scalars are checked here too: the dispatcher would refuse a wrong type with its own words.
    eps = _arrays.positive_finite("eps", eps)
    _registry.check_number(VERSIONS, version)
    if not cupy_in:
        if fast_path_applies([hs, *weights]):
            with _device.on(hs.device):
                return _run_cuda(hs, weights, eps, version, fast_path=True)
        return torch.ops.altup_cupy.collapse(hs, weights, eps, version)
    with _arrays.cupy_caller_stream(hs.device):
        return _arrays.to_cupy(_run_cuda(hs, weights, eps, version))
