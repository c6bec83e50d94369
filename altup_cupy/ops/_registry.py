"""What the ops share: numbered kernel versions, how one is picked for a call, and which calls
skip torch's dispatcher.

A version names the kernel sources it launches (their minimum compute capability is the
version's), says which shapes it serves, and builds a launch plan for one shape. Every plan of
every op is called the same way, on inputs the op has validated and outputs it has allocated:

    plan(inputs, outputs, scalars, stream, reuse_scratch)

inputs and outputs: tuples of tensors in the op's order (None for an optional tensor left out);
scalars: the op's float arguments in its schema's order (eps; eps, router_scale; floor); stream: the raw
CUDA stream handle the launches go to; reuse_scratch: whether scratch memory may be kept from call
to call (the eager fast path only, see `_scratch`). The dispatcher,
the tests, the benchmark and the figures all read the registry, so adding a version is its `.cu`
file, its `KernelSource` in `_sources.py`, and one `Version` entry.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from .. import _device


@dataclass(frozen=True)
class Version:
    number: int
    note: str  # one line: what this version changed
    sources: Sequence[Any]  # the KernelSources it launches
    supports: Callable[..., bool]  # (streams, hidden) -> whether its kernels serve this shape
    plan: Callable[..., Any]  # builds the launch plan of one shape (on a GPU), called as above
    # Why it stays registered although the default beats it on every recorded workload (a teaching
    # step, a portable fallback); empty for a version that wins somewhere. tests/test_registry.py
    # checks the recorded benchmark against it.
    kept_because: str = ""

    @property
    def min_compute_capability(self) -> int:
        return max(source.min_arch for source in self.sources)

    def runs_on(self, compute_capability: int, streams: int, hidden: int) -> bool:
        return compute_capability >= self.min_compute_capability and self.supports(streams, hidden)


def check_number(versions: Mapping[int, Version], requested: int | None) -> None:
    if requested is None:
        return
    # 1.0 and True equal 1 and would pass the lookup; the dispatcher then refuses them in its words
    if isinstance(requested, bool) or not isinstance(requested, numbers.Integral):
        raise TypeError(f"version must be None or an int, got {type(requested).__name__}")
    if requested not in versions:
        raise ValueError(f"version must be None or one of {tuple(versions)}, got {requested!r}")


def pick(versions: Mapping[int, Version], preference: Sequence[int], requested: int | None,
         compute_capability: int, streams: int, hidden: int, device_name: str) -> Version:
    """The requested version (a clear error if it cannot run here), or the first of `preference`
    that runs on this device and shape."""
    check_number(versions, requested)
    if requested is not None:
        chosen = versions[requested]
        if compute_capability < chosen.min_compute_capability:
            raise ValueError(
                f"version {requested} needs compute capability "
                f"{chosen.min_compute_capability / 10:.1f} or newer; {device_name} has "
                f"{compute_capability / 10:.1f}")
        if not chosen.supports(streams, hidden):
            raise ValueError(f"version {requested} does not serve N = {streams}, H = {hidden}; "
                             "version=None picks one that does")
        return chosen
    for number in preference:
        if versions[number].runs_on(compute_capability, streams, hidden):
            return versions[number]
    raise ValueError(f"no version serves N = {streams}, H = {hidden} on {device_name}")


def picker(versions: Mapping[int, Version],
           preference: Sequence[int]) -> Callable[[int | None, int, int, int], Version]:
    """`version(requested, streams, hidden, device index)`: the version that serves a call, picked
    once per shape and device (`pick` on the device's compute capability; the default choice under
    ALTUP_MAX_COMPUTE_CAPABILITY's cap). Each version caches its own plans."""
    @functools.lru_cache(maxsize=256)
    def version(requested: int | None, streams: int, hidden: int, index: int) -> Version:
        capability, name = _device.facts(index)
        if requested is None:
            capability = _device.default_dispatch_capability(capability)
        return pick(versions, preference, requested, capability, streams, hidden, name)
    return version


# Tensor subclasses (fake, functional, user subclasses) go through the dispatcher, which knows them.
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def fast_path_applies(tensors: Sequence[torch.Tensor]) -> bool:
    """Eager CUDA tensors with no autograd to record and no tracing: the dispatcher adds nothing,
    so the public function may hand them straight to the kernels."""
    if torch.compiler.is_compiling():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if not t.is_cuda or (grad and t.requires_grad) or type(t) not in _PLAIN_TENSORS:
            return False
    return True
