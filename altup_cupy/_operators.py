"""Operators of the `altup_cupy` namespace registered straight with PyTorch's dispatcher.

`torch.library.custom_op` wraps every call in Python layers of its own (its device-type dispatch,
argument checks) before the implementation runs; a `torch.library.Library` registration of the
same function skips them (`python -m altup_cupy.lab.op_registration` measures both, with and
without autograd; results/nvidia-h200/op_registration.csv). The Gemma 3n steps run four operators
per decoder layer, so at small batch the host, not the GPU, sets the pace. Registered this way, an
operator is one schema, one implementation for the CPU and CUDA dispatch keys, and a fake
implementation for torch.compile.

`Operator.register_autograd` makes it differentiable with torch's own autograd kernel
(`torch.library.register_autograd`'s), behind one shortcut: a call that records no gradient on
plain CPU or CUDA tensors (a compiled graph's calls, inference, no_grad) goes straight to the
implementation instead of through that kernel's Python layers and a second dispatch, which cost
more than the dispatcher call itself (the `Library` and `Operator` rows of op_registration.csv).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch._library import autograd as library_autograd

NAMESPACE = "altup_cupy"
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")
# The dispatch keys whose kernel is the implementation itself: after the autograd keys, a plain
# tensor's key set holds only its backend; a fake, functional or otherwise wrapped tensor, or a
# dispatch mode, adds keys of higher priority (Python, Functionalize, ...) that must see the call.
_PLAIN_BACKENDS = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset


class Operator:
    """torch.ops.altup_cupy.<name>, defined by `schema` and implemented by `impl` on CPU and CUDA
    tensors (impl branches on the device itself). `library`: another namespace's (the registration
    cost probes of altup_cupy.lab.op_registration)."""

    def __init__(self, schema: str, impl: Callable, library: torch.library.Library = _LIBRARY):
        self.name = schema.split("(", 1)[0]
        self.namespace = library.ns
        self.qualname = f"{self.namespace}::{self.name}"
        self.impl = impl
        self._library = library
        library.define(schema)
        for dispatch_key in ("CPU", "CUDA"):
            library.impl(self.name, impl, dispatch_key)

    def register_fake(self, fake: Callable) -> Callable:
        """The shape-only implementation torch.compile and FakeTensorMode run."""
        torch.library.register_fake(self.qualname, fake, lib=self._library)
        return fake

    def register_autograd(self, backward: Callable, setup_context: Callable) -> None:
        """Differentiable as `torch.library.register_autograd(qualname, backward,
        setup_context=setup_context)` makes it, with the shortcut of the module docstring."""
        overload = getattr(getattr(torch.ops, self.namespace), self.name).default
        recording = library_autograd.make_autograd_impl(overload, library_autograd.Info(backward, setup_context))

        def autograd_kernel(keyset, *args, **kwargs):
            if ((keyset & _AFTER_AUTOGRAD).highestPriorityTypeId() in _PLAIN_BACKENDS
                    and not (torch.is_grad_enabled() and torch._C._any_requires_grad(*args))):
                return self.impl(*args, **kwargs)
            return recording(keyset, *args, **kwargs)

        self._library.impl(self.name, autograd_kernel, "Autograd", with_keyset=True)


def operator(schema: str) -> Callable[[Callable], Operator]:
    """Decorator: `@operator("predict(Tensor x, ...) -> Tensor")` over the implementation."""
    return lambda impl: Operator(schema, impl)
